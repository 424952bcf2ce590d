"""`kvproxy bench store --entries N`: what the disk index costs at N entries, no llama-server.

It builds a synthetic cache dir as kvproxy before the SQLite index left one (a 4 KiB `.kv` and
a `.idx` record per entry, chains of 2-40 keys, `shared` of them opening with one system
prompt), then measures, on this machine:

- the first open, which imports the `.idx` records (once);
- `kvproxy serve` over the fake llama-server (bench/kvproxy_fake/server.py): until `/health`
  answers, until the cache is open and on, and its RSS against the same proxy on an empty
  cache dir (per entry);
- in-process, the store calls the proxy makes: a save's bookkeeping (commit, victim selection,
  deletion: the budget is full, so every save evicts), a restore's (file check, use recorded;
  the checksum runs beside the server's own read and is shown apart), housekeeping's per-second
  work, and the lookup of a new conversation whose system prompt `shared` entries share;
- `kvproxy ls --limit 20`, `rm <prefix>` and `gc` evicting `gc_entries`, as processes (their
  times include Python's start-up, shown apart).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from kvproxy_fake.server import FakeLlamaServer

from kvproxy.keys import KEY_HEX_LEN
from kvproxy.server.managed import free_port
from kvproxy.store import STATE_MAGIC, Entry, Store
from kvproxy_bench.report import progress

NS = "0" * KEY_HEX_LEN  # one namespace: the worst case for lookups
STATE = 4096


@dataclass
class StoreOptions:
    entries: int = 10_000
    shared: int = 5_000  # entries opening with one system prompt (at most half of them)
    gc_entries: int = 10_000  # what `gc` evicts (at most half of them)
    samples: int = 50  # timed repetitions of each in-process call


@dataclass
class StoreResult:
    options: dict[str, Any]
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (what, measured, target)
    raw: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"options": self.options, "rows": self.rows, "raw": self.raw}


# --- the synthetic cache dir


def state_bytes() -> bytes:
    head = (
        STATE_MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little") + (10).to_bytes(4, "little")
    )
    return head + b"\0" * (STATE - len(head))


def build_legacy(root: Path, n: int, shared: int) -> str:
    """Write `n` entries as `.kv` + `.idx`; the shared system prompt's key."""
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    data = state_bytes()
    system = secrets.token_hex(KEY_HEX_LEN // 2)
    now = time.time()
    for i in range(n):
        length = 2 + i % 39
        chain = [secrets.token_hex(KEY_HEX_LEN // 2) for _ in range(length)]
        if i < shared:
            chain[0] = system
        entry = Entry(chain[-1], NS, 100 * length, STATE, length, now - n + i, now - n + i)
        entry.chain = chain
        (root / f"{entry.key}.kv").write_bytes(data)
        (root / f"{entry.key}.idx").write_bytes(entry.to_json())
        if i and i % 20_000 == 0:
            progress(f"  {i:,} entries written")
    return system


# --- measuring


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} µs"


async def _timed(samples: int, call: Callable[[], Awaitable[Any]]) -> tuple[float, float]:
    """Median and 95th percentile of `samples` awaited calls, in seconds."""
    times = []
    for _ in range(samples):
        started = time.perf_counter()
        await call()
        times.append(time.perf_counter() - started)
    times.sort()
    return statistics.median(times), times[min(len(times) - 1, int(len(times) * 0.95))]


def _deep_size(heads: Any) -> int:
    """Bytes of the heads' dictionaries and the integers in them."""
    total = 0
    for held in heads._held.values():
        total += sys.getsizeof(held) + sum(sys.getsizeof(k) for k in held)
    return total


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def _serve(upstream: str, root: Path) -> tuple[float, float, int]:
    """Start `kvproxy serve`: seconds until /health answers, until the cache is open and on,
    and its RSS then (KiB)."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvproxy.cli", "serve", "--upstream", upstream]
    cmd += ["--cache-dir", str(root), "--port", str(port), "--max-disk", "1TB", "--ttl", "0"]
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    health = ready = 0.0
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while not ready:
                if proc.returncode is not None:
                    raise RuntimeError(f"kvproxy serve exited with {proc.returncode}")
                if time.perf_counter() - started > 600:
                    raise RuntimeError("kvproxy serve did not come up in 600 s")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    if not health:
                        async with s.get(f"http://127.0.0.1:{port}/health") as r:
                            if r.status == 200:
                                health = time.perf_counter() - started
                    if health:
                        async with s.get(f"http://127.0.0.1:{port}/kvproxy/stats") as r:
                            state = await r.json()
                            if state.get("cache_open") and state.get("enabled"):
                                ready = time.perf_counter() - started
                await asyncio.sleep(0.005)
        await asyncio.sleep(2.5)  # housekeeping's first ticks (the first reads the heads)
        rss = await asyncio.to_thread(_rss_kib, proc.pid)
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
    return health, ready, rss


def _cli(*argv: str) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "kvproxy.cli", *argv], capture_output=True, text=True, check=True
    )
    return time.perf_counter() - started, done.stdout


async def _save(store: Store) -> float:
    """A save's bookkeeping, as SlotWork.save (kvproxy/cache/slotio/slotwork.py) does it once the
    server wrote the file: its seconds."""
    key = secrets.token_hex(KEY_HEX_LEN // 2)
    temp = store.temp_name(key)
    await asyncio.to_thread((store.root / temp).write_bytes, state_bytes())
    now = time.time()
    entry = Entry(key, NS, 200, 0, 2, now, now, chain=[secrets.token_hex(16), key])
    started = time.perf_counter()
    await store.commit_async(entry, temp)
    victims = await store.select_victims_async()
    await store.delete_files_async(victims)
    assert victims, "the budget is full: every save evicts"
    return time.perf_counter() - started


class _IndexClock:
    """Seconds the store's index thread spends in SQLite (its calls, timed where they run)."""

    def __init__(self, store: Store) -> None:
        self.seconds = 0.0
        run = store._with_totals

        def timed(work: Callable[[Any], Any], refresh: bool = True) -> Any:
            started = time.perf_counter()
            try:
                return run(work, refresh)
            finally:
                self.seconds += time.perf_counter() - started

        store._with_totals = timed  # type: ignore[method-assign]


async def _commit_files(store: Store) -> float:
    key = secrets.token_hex(KEY_HEX_LEN // 2)
    temp = store.temp_name(key)
    await asyncio.to_thread((store.root / temp).write_bytes, state_bytes())
    entry = Entry(key, NS, 200, 0, 2, 0.0, 0.0, chain=[key])
    started = time.perf_counter()
    await asyncio.to_thread(store.files.commit, entry, temp, None)
    seconds = time.perf_counter() - started
    await asyncio.to_thread(store.files.delete, [entry])
    return seconds


async def run_store(workdir: Path, opts: StoreOptions) -> StoreResult:
    n = opts.entries
    shared = min(opts.shared, n // 2)
    gc_n = min(opts.gc_entries, n // 2)
    result = StoreResult(options={**asdict(opts), "shared": shared, "gc_entries": gc_n})
    raw = result.raw
    root = workdir / "cache"
    progress(f"writing {n:,} entries (.kv + .idx) to {root}")
    system = await asyncio.to_thread(build_legacy, root, n, shared)

    progress("first open: importing the .idx records")
    started = time.perf_counter()
    importer = Store(root, 0, 0)
    await asyncio.to_thread(importer.open)
    raw["import_s"] = time.perf_counter() - started
    assert importer.summary.entries == n, importer.summary
    await asyncio.to_thread(importer.close)

    progress("kvproxy serve over the fake llama-server")
    empty = workdir / "empty"
    empty.mkdir(mode=0o700)
    async with FakeLlamaServer(slot_save_path=root) as fake:
        raw["health_s"], raw["ready_s"], rss = await _serve(fake.url, root)
    async with FakeLlamaServer(slot_save_path=empty) as fake:
        raw["health_empty_s"], _, rss0 = await _serve(fake.url, empty)
    raw["rss_mib"] = rss / 1024
    raw["rss_per_entry_b"] = max(0, rss - rss0) * 1024 / n

    progress("the store's calls, in-process")
    store = Store(root, 0, 0)
    await store.open_async()
    total = store.summary.bytes
    store.max_bytes = total  # full: every save evicts the least recently used entry
    in_index = _IndexClock(store)
    times, index_times = [], []
    for _ in range(opts.samples):
        before = in_index.seconds
        times.append(await _save(store))
        index_times.append(in_index.seconds - before)
    times.sort()
    raw["save_ms"] = statistics.median(times) * 1000
    raw["save_p95_ms"] = times[int(len(times) * 0.95)] * 1000
    raw["save_index_ms"] = statistics.median(index_times) * 1000
    # Of which the files alone: rename, fsync of the state and of the directory (as before
    # the database), no index work.
    times = sorted([await _commit_files(store) for _ in range(opts.samples)])
    raw["save_files_ms"] = statistics.median(times) * 1000
    store.max_bytes = 0

    picks = [e for _, e in zip(range(opts.samples), store.entries.values(), strict=False)]
    it = iter(picks * 2)

    async def restore_check() -> None:
        """What SlotWork.restore (kvproxy/cache/slotio/slotwork.py) does before it asks the server
        (the use is recorded in the background after it)."""
        entry = next(it)
        store.pin(entry.key)
        try:
            problem = await asyncio.to_thread(store.files.check_state_file, entry)
            assert problem is None, problem
        finally:
            store.unpin(entry.key)

    med, p95 = await _timed(len(picks), restore_check)
    raw["restore_ms"], raw["restore_p95_ms"] = med * 1000, p95 * 1000
    touched = iter(picks * 2)
    med, _ = await _timed(len(picks), lambda: store.touch_async(next(touched).key))
    raw["touch_ms"] = med * 1000
    checks = iter(picks * 2)
    med, _ = await _timed(
        len(picks), lambda: asyncio.to_thread(store.files.verify_checksum, next(checks))
    )
    raw["checksum_ms"] = med * 1000

    await store.refresh_async()  # housekeeping's first tick: the heads are read
    started = time.perf_counter()
    store.heads.stale()
    await store.refresh_async()
    raw["heads_load_s"] = time.perf_counter() - started

    async def housekeeping() -> None:
        await store.refresh_async()
        await store.select_victims_async()

    store.max_bytes = total * 2  # under budget: the usual second
    med, _ = await _timed(opts.samples, housekeeping)
    raw["housekeeping_ms"] = med * 1000

    raw["heads_keys"] = len(store.heads)
    raw["heads_mib"] = _deep_size(store.heads) / 2**20
    new_conversation = [system, secrets.token_hex(KEY_HEX_LEN // 2)]
    # Each a new session: its own first user message, never stored.
    sessions = iter([[system, secrets.token_hex(KEY_HEX_LEN // 2)] for _ in range(opts.samples)])
    med, _ = await _timed(opts.samples, lambda: store.candidates_async(next(sessions), NS))
    raw["lookup_shared_us"] = med * 1e6
    found = await store.candidates_async(new_conversation, NS)
    assert found and found[0][1] == 1, found  # the system prompt's entries match at depth 1
    nothing = iter([[secrets.token_hex(KEY_HEX_LEN // 2)] * 2 for _ in range(opts.samples)])
    med, _ = await _timed(opts.samples, lambda: store.candidates_async(next(nothing), NS))
    raw["lookup_nothing_us"] = med * 1e6
    continuing = [*picks[0].chain, secrets.token_hex(KEY_HEX_LEN // 2)]
    med, _ = await _timed(opts.samples, lambda: store.candidates_async(continuing, NS))
    raw["lookup_continuing_us"] = med * 1e6
    await asyncio.to_thread(store.close)
    # The queries alone, as the index thread runs them, without the hop there and back.
    sync_store = Store(root, 0, 0)
    sync_store.open_readonly()
    db = sync_store._conn()
    times = []
    for _ in range(opts.samples):
        begun = time.perf_counter()
        db.candidates(new_conversation, NS)
        times.append(time.perf_counter() - begun)
    raw["lookup_shared_query_us"] = statistics.median(times) * 1e6
    sync_store.close()

    progress("kvproxy ls / rm / gc")
    raw["python_start_s"], _ = await asyncio.to_thread(_cli, "--help")
    raw["ls_s"], out = await asyncio.to_thread(
        _cli, "ls", "--limit", "20", "--cache-dir", str(root)
    )
    assert out.count("\n") >= 21, out
    raw["rm_s"], out = await asyncio.to_thread(
        _cli, "rm", picks[1].key[:12], "--cache-dir", str(root)
    )
    assert "removed 1 entry" in out, out
    counted = Store(root, 0, 0)
    counted.open_readonly()
    budget = str(counted.summary.bytes - gc_n * STATE)  # exactly gc_n over it
    counted.close()
    raw["gc_dry_s"], out = await asyncio.to_thread(
        _cli, "gc", "--dry-run", "--max-disk", budget, "--cache-dir", str(root)
    )
    raw["gc_s"], out = await asyncio.to_thread(
        _cli, "gc", "--max-disk", budget, "--cache-dir", str(root)
    )
    raw["gc_evicted"] = float(out.split("evicted ", 1)[1].split(" ", 1)[0])

    result.rows = [
        ("first open of an old `.idx` cache dir (import, once)", f"{raw['import_s']:.2f} s", ""),
        (
            "`kvproxy serve` until `/health` answers (on an empty cache dir)",
            f"{raw['health_s']:.2f} s ({raw['health_empty_s']:.2f} s)",
            "< 2 s",
        ),
        ("`kvproxy serve` until the cache is open and on", f"{raw['ready_s']:.2f} s", ""),
        (
            "proxy RSS (per entry, against an empty cache dir)",
            f"{raw['rss_mib']:.0f} MiB ({raw['rss_per_entry_b']:.0f} B)",
            "< 1 KiB",
        ),
        (
            "every save: commit + victim selection + deletion (median / p95)",
            f"{_ms(raw['save_ms'] / 1000)} / {_ms(raw['save_p95_ms'] / 1000)}",
            "< 5 ms",
        ),
        (
            "  of which the index's own work, on its thread (SQLite)",
            _ms(raw["save_index_ms"] / 1000),
            "",
        ),
        (
            "  the files alone, for comparison (rename, fsync state and directory)",
            _ms(raw["save_files_ms"] / 1000),
            "",
        ),
        (
            "every restore: the file check before the server's call (median / p95)",
            f"{_ms(raw['restore_ms'] / 1000)} / {_ms(raw['restore_p95_ms'] / 1000)}",
            "< 2 ms",
        ),
        ("  then, in the background: the use recorded", _ms(raw["touch_ms"] / 1000), ""),
        (
            "  and beside the server's read: checksum of a 4 KiB state",
            _ms(raw["checksum_ms"] / 1000),
            "",
        ),
        (
            "housekeeping, every second (summary + budget)",
            _ms(raw["housekeeping_ms"] / 1000),
            "< 1 ms",
        ),
        (
            f"lookup of a new conversation whose system prompt {shared:,} entries share",
            f"{_us(raw['lookup_shared_us'] / 1e6)} (the index's query alone: "
            f"{_us(raw['lookup_shared_query_us'] / 1e6)})",
            "< 100 µs",
        ),
        (
            "lookup of a conversation sharing nothing stored",
            _us(raw["lookup_nothing_us"] / 1e6),
            "",
        ),
        ("lookup of a continuing conversation", _us(raw["lookup_continuing_us"] / 1e6), ""),
        (
            "first two keys of every entry, kept in memory (`heads`): keys, size, read in",
            f"{int(raw['heads_keys']):,}, {raw['heads_mib']:.1f} MiB "
            f"({raw['heads_mib'] * 2**20 / n:.0f} B per entry), {raw['heads_load_s']:.2f} s",
            "",
        ),
        (
            "`kvproxy ls --limit 20` / `rm <prefix>` (Python start-up alone: "
            f"{raw['python_start_s']:.2f} s)",
            f"{raw['ls_s']:.2f} / {raw['rm_s']:.2f} s",
            "< 1 s",
        ),
        (
            f"`kvproxy gc` evicting {int(raw['gc_evicted']):,} (`--dry-run`)",
            f"{raw['gc_s']:.2f} s ({raw['gc_dry_s']:.2f} s)",
            "< 60 s for 10k",
        ),
    ]
    return result


def markdown(result: StoreResult) -> str:
    n = result.options["entries"]
    lines = [f"| {n:,} entries | measured | target at 100k |", "|---|---|---|"]
    lines += [f"| {what} | {got} | {target} |" for what, got, target in result.rows]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    opts = StoreOptions()
    if args.entries is not None:
        opts.entries = args.entries
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvproxy-bench-store-"))
    workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        result = asyncio.run(run_store(workdir, opts))
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            progress(f"work dir kept: {workdir}")
    print(f"## store\n\n{markdown(result)}\n", flush=True)
    return 0
