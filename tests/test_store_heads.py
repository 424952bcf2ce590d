"""Lookups answered on the event loop (`kvproxy/store/heads.py`) give the index's own answer,
whatever saves, uses, removals, evictions and other processes did before."""

from __future__ import annotations

import asyncio
import random
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproxy import keys
from kvproxy.store import STATE_MAGIC, Entry, IndexDB, Store

NAMESPACES = [keys.namespace(m, {}, None) for m in ("m1", "m2")]
SYSTEMS = ["You are a coder.", "You are a poet.", "You are a cook."]


def state_bytes(size: int = 1000) -> bytes:
    head = (
        STATE_MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little") + (13).to_bytes(4, "little")
    )
    return head + b"\0" * (size - len(head))


def chain_of(ns: int, system: int, tail: list[int]) -> list[str]:
    """A conversation on one of a few system prompts, its messages from a small alphabet, so
    that stored conversations share openings and fork."""
    messages = [{"role": "system", "content": SYSTEMS[system]}]
    messages += [{"role": "user", "content": f"say {t}"} for t in tail]
    return keys.chain(NAMESPACES[ns], messages)


def random_ops(rng: random.Random, n: int) -> list[tuple[Any, ...]]:
    """Saves, uses, removals, evictions, another process's removals and lookups, in the
    proportions that make a remembered entry change often before it is looked up again."""

    def conversation(tail: int) -> tuple[int, int, list[int]]:
        return (
            rng.choice([0, 0, 0, 1]),
            rng.randint(0, 1),
            [rng.randint(0, 2) for _ in range(tail)],
        )

    ops: list[tuple[Any, ...]] = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.3:
            ops.append(("save", conversation(rng.randint(0, 2)), rng.choice([100.0, 200.0, 300.0])))
        elif roll < 0.4:
            ops.append(("touch", rng.randint(0, 50)))
        elif roll < 0.5:
            ops.append(("remove", rng.randint(0, 50)))
        elif roll < 0.55:
            ops.append(("evict", rng.randint(0, 4)))
        elif roll < 0.6:
            ops.append(("outside", rng.randint(0, 50)))
        else:  # mostly new sessions: a stored system prompt, then a message never stored
            ops.append(("lookup", conversation(rng.choice([0, 0, 0, 1, 2]))))
    return ops


async def save(store: Store, chain: list[str], ns: int, used: float) -> Entry:
    temp = store.temp_name(chain[-1])
    await asyncio.to_thread((store.root / temp).write_bytes, state_bytes())
    entry = Entry(chain[-1], NAMESPACES[ns], 10, 0, len(chain), used, used, chain=chain)
    return await store.commit_async(entry, temp)


def remove_elsewhere(root: Path, key: str) -> None:
    other = Store(root, ttl=0, max_bytes=0)
    other.remove(key)
    other.close()


def index_answer(request: list[str], namespace: str, db: IndexDB) -> list[tuple[Entry, int]]:
    return db.candidates(request, namespace)


def seen(found: list[tuple[Entry, int]]) -> list[tuple[str, int, float, int, int]]:
    return [(e.key, d, e.last_used, e.row_id, len(e.chain)) for e, d in found]


async def scenario(root: Path, ops: list[tuple[Any, ...]]) -> int:
    """Runs `ops`; every lookup is compared with the index's answer. How many the loop
    answered."""
    store = Store(root, ttl=0, max_bytes=0)
    await store.open_async()
    await store.refresh_async()  # housekeeping's first tick reads the entries' first keys
    saved: list[Entry] = []
    answered = 0
    try:
        for name, *args in ops:
            if name == "save":
                (ns, system, tail), used = args
                saved.append(await save(store, chain_of(ns, system, tail), ns, used))
            elif name == "touch" and saved:
                await store.touch_async(saved[args[0] % len(saved)].key)
            elif name == "remove" and saved:
                await store.remove_async(saved.pop(args[0] % len(saved)))
            elif name == "evict":
                store.max_bytes = 1000 * args[0] + 1  # keeps at most that many entries
                await store.delete_files_async(await store.select_victims_async())
                store.max_bytes = 0
            elif name == "outside" and saved:
                # `kvproxy rm` in another process; housekeeping's next tick sees it.
                await asyncio.to_thread(remove_elsewhere, root, saved[args[0] % len(saved)].key)
                await store.refresh_async()
            elif name == "lookup":
                ns, system, tail = args[0]
                request = chain_of(ns, system, [*tail, 9])  # and a message never stored
                namespace = NAMESPACES[ns]
                for _ in range(2):  # the second time, the entry found may be remembered
                    on_loop = store.heads.answer(request, namespace) is not None
                    got = await store.candidates_async(request, namespace)
                    truth = await store._db(
                        partial(index_answer, request, namespace), refresh=False
                    )
                    assert seen(got) == seen(truth), (request, ops)
                    answered += on_loop
    finally:
        await asyncio.to_thread(store.close)
    return answered


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.integers(10, 60))
def test_the_loop_answers_as_the_index_does(seed: int, n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(scenario(Path(tmp), random_ops(random.Random(seed), n)))


async def test_a_new_session_on_a_stored_opening_needs_no_index_query(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    await store.refresh_async()
    stored = [await save(store, chain_of(0, 0, [t]), 0, time.time()) for t in range(3)]
    newest = stored[-1]
    jobs = store._jobs
    assert await store.candidates_async(chain_of(1, 0, [7]), NAMESPACES[1]) == []
    assert await store.candidates_async(chain_of(0, 1, [7]), NAMESPACES[0]) == []
    assert store._jobs == jobs  # nothing stored there: known on the loop
    first = await store.candidates_async(chain_of(0, 0, [7]), NAMESPACES[0])
    assert [(e.key, d) for e, d in first] == [(newest.key, 1)]  # asked once ...
    jobs = store._jobs
    again = await store.candidates_async(chain_of(0, 0, [8]), NAMESPACES[0])
    assert [(e.key, d) for e, d in again] == [(newest.key, 1)]
    assert store._jobs == jobs  # ... then answered on the loop
    await store.touch_async(stored[0].key)  # now the most recently used
    again = await store.candidates_async(chain_of(0, 0, [8]), NAMESPACES[0])
    assert [(e.key, d) for e, d in again] == [(stored[0].key, 1)]
    # A continuing conversation is deeper than the loop knows: the index answers.
    jobs = store._jobs
    deeper = await store.candidates_async(chain_of(0, 0, [1, 2]), NAMESPACES[0])
    assert [(e.key, d) for e, d in deeper] == [(stored[1].key, 2)]
    assert store._jobs == jobs + 1
    await asyncio.to_thread(store.close)


async def test_until_the_first_keys_are_read_the_index_answers(tmp_path: Path) -> None:
    store = Store(tmp_path, ttl=0, max_bytes=0)
    await store.open_async()
    entry = await save(store, chain_of(0, 0, [1]), 0, 100.0)
    assert store.heads.answer(chain_of(0, 0, [2]), NAMESPACES[0]) is None
    found = await store.candidates_async(chain_of(0, 0, [2]), NAMESPACES[0])
    assert [(e.key, d) for e, d in found] == [(entry.key, 1)]
    await asyncio.to_thread(store.close)
