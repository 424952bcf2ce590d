"""The cache's decisions, on plain data: no I/O, no clock, no server (tests/test_layers.py).

What to do with a request's slot and the store (policy.py), whether a restore pays
(payoff.py), which slot a request goes to (slotchoice.py), when a save may start and which idle
slot to save first (moments.py, pressure.py), what a shutdown saves (shutdownplan.py), the
conversations waiting for a tool's result (toolloops.py), what prefill costs (prefillrate.py),
and the bounds on what clients can make kvproxy keep (bounds.py). The floors above run them.
"""
