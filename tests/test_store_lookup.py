"""The prefix lookup (`kvproxy.store.lookup`) against a plain-Python reference, on rows built
as conversations branch: shared system prompts, forks, long agent sessions."""

from __future__ import annotations

import random
from pathlib import Path

from kvproxy.store import Entry, IndexDB
from kvproxy.store.lookup import MAX_PARAMS, PROBES

NS, OTHER = "a" * 32, "b" * 32


def key(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def reference(entries: list[Entry], keys: list[str], ns: str) -> list[tuple[str, int]]:
    """What the lookup must answer, by a pass over every entry: the entry sharing the longest
    prefix (ending closest to it, then most recently used, then first stored), then the
    other entries whose key is one of `keys`, deepest first."""
    out: list[tuple[str, int]] = []
    mine = [e for e in entries if e.namespace == ns]

    def shared(e: Entry) -> int:
        n = 0
        while n < min(len(e.chain), len(keys)) and e.chain[n] == keys[n]:
            n += 1
        return n

    best = max((shared(e) for e in mine), default=0)
    if best:
        tied = [e for e in mine if shared(e) == best]
        tied.sort(key=lambda e: (len(e.chain), -e.last_used, e.row_id))
        out.append((tied[0].key, best))
    position = {k: i + 1 for i, k in enumerate(keys)}
    ending = sorted(
        ((e.key, position[e.key]) for e in mine if e.key in position), key=lambda p: -p[1]
    )
    return out + [p for p in ending if not out or p[0] != out[0][0]]


def test_candidates_match_a_pass_over_every_entry(tmp_path: Path) -> None:
    rng = random.Random(15)
    db = IndexDB(tmp_path)
    systems = [[key(rng)] for _ in range(3)]
    chains: list[list[str]] = [list(s) for s in systems]
    for _ in range(300):  # conversations continuing, forking, or starting on a system prompt
        base = rng.choice(chains)
        cut = rng.randint(1, len(base))
        chains.append(base[:cut] + [key(rng) for _ in range(rng.choice([1, 1, 2, 5, 40]))])
    chains.append(chains[-1] + [key(rng) for _ in range(MAX_PARAMS + 300)])  # a long session
    entries = []
    for i, chain in enumerate(chains[3:]):
        ns = OTHER if i % 17 == 0 else NS
        used = float(rng.choice([100, 200, 300]))  # ties, broken by the row order
        entries.append(Entry(chain[-1], ns, 10, 100, len(chain), used, used, chain=chain))
    db.insert_many(entries)
    stored = [db.get(e.key) for e in entries]
    rows = [e for e in stored if e is not None]
    requests = [[*s, key(rng)] for s in systems]  # a new conversation on a shared prompt
    requests += [[key(rng), key(rng)]]  # nothing shared
    for _ in range(200):
        base = rng.choice(chains)
        cut = rng.randint(1, len(base))
        requests.append(base[:cut] + [key(rng) for _ in range(rng.choice([0, 1, 1, 3]))])
    deep = 0
    for keys in requests:
        got = [(e.key, d) for e, d in db.candidates(keys, NS)]
        assert got == reference(rows, keys, NS), keys
        longest = db.longest(keys, NS)
        assert (None if not got else got[0]) == (
            None if longest is None else (longest[0].key, longest[1])
        )
        deep += bool(got) and got[0][1] > PROBES
    assert deep > 10  # the depth search took several statements often enough to be tested
    assert db.candidates(requests[0], "c" * 32) == []  # a namespace nobody stored
    db.close()
