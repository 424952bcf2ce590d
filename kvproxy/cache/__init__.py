"""What outlives a request: the slots and what each holds, saves and restores, and the rules
deciding them. No aiohttp here: the lanes (lanes/) and the request handlers (handlers/) stand
on it.

Its floors, from the top down; each imports only its own and lower ones (tests/test_layers.py):

- scheduling/: slot work beside the requests (saves in moments that pause nobody, prefetches);
- prefixes/: what of a request is already held somewhere, and the openings and stems kept;
- slotio/: the I/O a slot goes through (verify, save, restore, clear);
- disk/: a state's life on disk (its commit, saves under way, room, lineage);
- context.py: what every part of the cache is given;
- habits/: what clients do to a conversation between turns;
- servers/: each llama-server as the cache knows it (its slots, the pool, leases, pace);
- reports/: what the cache tells (events, explained misses, faults);
- decisions/: the rules, on plain data; canonical/: the canonical prefix.
"""
