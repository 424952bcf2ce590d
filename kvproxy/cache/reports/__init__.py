"""What the cache tells about its work.

The events the metrics and the request log listen to (events.py), a miss explained
(explain.py), whether a hit was the request's own earlier state (labels.py), and the faults of
work nobody waits for (faults.py).
"""
