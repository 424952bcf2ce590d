"""What of a request is already held somewhere, and the prefixes kept for new sessions.

What the server will reuse of each slot and each stored state (reuse.py); a namespace's shared
opening (openings.py) and a system prompt's stem (stems.py), kept as entries of their own so
that new sessions start warm.
"""
