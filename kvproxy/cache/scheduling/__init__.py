"""Slot work that runs beside the requests: one save at a time, each in a moment that pauses
nobody (savegate.py), idle slots saved before a request needs them (background_saves.py), and
a tool loop's conversation restored before its next request comes (prefetch.py)."""
