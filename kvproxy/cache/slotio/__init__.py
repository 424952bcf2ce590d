"""The I/O a slot goes through on the server: verify it, save it (canonical prefix first),
restore into it (slotwork.py), and clear it of another tenant's tokens (clearing.py)."""
