"""The conversation cache: keyed and unkeyed requests, getting a conversation's state into a
slot (resident, restored or cold), the slot pool, saves in the background, openings shared
by sessions, the clients' habits, the canonical prefix, and the policy deciding all of it."""
