"""The I/O a slot goes through on the server.

Verify it, save it (canonical prefix first), restore into it (slotwork.py); clear it of
another tenant's tokens (clearing.py).
"""
