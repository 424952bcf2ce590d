"""What of a request is already held somewhere: what the server will reuse of each slot and
each stored state (reuse.py), and the prefixes kept as entries of their own so that new
sessions start warm: a namespace's shared opening (openings.py) and a system prompt's stem
(stems.py)."""
