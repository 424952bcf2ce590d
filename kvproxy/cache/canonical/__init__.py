"""The canonical prefix (prefix.py) and the tokenising it rests on (tokensplit.py)."""
