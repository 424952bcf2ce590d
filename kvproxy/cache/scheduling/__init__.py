"""Slot work beside the requests, each piece in its moment.

One save at a time, each in a moment that pauses nobody (savegate.py); idle slots saved before
a request needs them (background_saves.py); a tool loop's conversation restored before its
next request comes (prefetch.py).
"""
