"""What outlives a request: the slots and what each holds, the pool, the slot I/O (verify,
save, restore), saves in the background, openings and stems shared by sessions, the clients'
habits, the canonical prefix, and the policy deciding all of it. No aiohttp here: the lanes
(lanes/) and the request handlers (handlers/) stand on it."""
