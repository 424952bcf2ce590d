"""A slot state's life on disk, from the server's write on.

Its commit into the store (commits.py), saves under way (saving.py), room under --max-disk
(room.py), the older states a newer one supersedes (lineage.py), states the server refused to
restore (refused.py), and trouble with the cache dir told once (disktrouble.py). The files and
the index are the store package's.
"""
