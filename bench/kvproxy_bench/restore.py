"""`restore`: time to first token for a returning conversation, restored from disk by kvproxy
versus re-prefilled, at growing sizes, beside the physical limit.

Per size (tokens of the returning turn's prompt):

- direct server (`--cache-ram 0`, one slot): turn 1, then turn 2 while the conversation is
  still resident in the slot ("resident"), then the same turn 2 with `cache_prompt: false`,
  which makes the server prefill all of it ("re-prefill");
- kvproxy (one slot): turn 1, then a short other conversation takes the slot (kvproxy saves
  the first one to disk), the state file is dropped from the page cache, then turn 2:
  kvproxy restores it from disk ("restored, cold file").
- the state file's size, and the time to read it cold (after `posix_fadvise(DONTNEED)`) and
  again from the page cache. Physical limit = resident + cold read: nothing that has to read
  the state from disk can do better.

Time to first token is the wall time of a non-streamed request with `max_tokens: 1`: the
reply comes back as soon as the first token is sampled. Resident and restored times are the
median of `repeats` returning questions (each a different new turn on the same history);
re-prefill is measured once (it is long, so its noise is small).
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvproxy_bench.arms import BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.client import Client, Reply
from kvproxy_bench.dialogues import first_turn, next_turn
from kvproxy_bench.report import progress, table

FILLER = [{"role": "user", "content": "Hi"}]
READ_CHUNK = 8 * 1024 * 1024


@dataclass
class RestoreOptions:
    sizes: tuple[int, ...] = (1024, 2048, 4096, 8192)
    min_tokens: int = 256  # kvproxy --min-tokens (the default); lower it for tiny sizes
    turn1_tokens: int = 8  # reply length of turn 1
    repeats: int = 3  # resident and restored TTFT: median of this many returning questions

    @property
    def ctx_per_slot(self) -> int:
        need = max(self.sizes) + 512
        return -(-need // 256) * 256


@dataclass
class Point:
    target: int
    tokens: int = 0  # the returning turn's prompt, as the server counted it
    resident_s: float = 0.0
    resident_cached: int = 0
    reprefill_s: float = 0.0
    reprefill_cached: int = 0
    restored_s: float = 0.0
    restored_cached: int = 0
    restored_state: str = ""
    restore_ms: float = 0.0  # X-KVProxy-Restore-Ms: the server's restore call as kvproxy saw it
    state_bytes: int = 0
    cold_read_s: float = 0.0
    warm_read_s: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def limit_s(self) -> float:
        return self.resident_s + self.cold_read_s

    @property
    def vs_limit(self) -> float:
        return self.restored_s / self.limit_s if self.limit_s else 0.0

    @property
    def speedup(self) -> float:
        return self.reprefill_s / self.restored_s if self.restored_s else 0.0


@dataclass
class RestoreResult:
    options: dict[str, Any]
    points: list[Point] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "points": [
                {**asdict(p), "limit_s": p.limit_s, "vs_limit": p.vs_limit, "speedup": p.speedup}
                for p in self.points
            ],
        }


async def run_restore(env: BenchEnv, opts: RestoreOptions) -> RestoreResult:
    result = RestoreResult(options={**asdict(opts), "ctx_per_slot": opts.ctx_per_slot})
    points = {size: Point(size) for size in opts.sizes}
    result.points = list(points.values())
    convs: dict[int, list[dict[str, Any]]] = {}
    client = Client()
    try:
        progress("restore: direct server (--cache-ram 0), one slot")
        async with DirectArm(env, 1, opts.ctx_per_slot, ram_cache=False) as direct:
            for size, point in points.items():
                convs[size] = await _conversation(client, direct.url, size)
                await _direct(client, direct.url, convs[size], point, opts)
        progress("restore: kvproxy, one slot")
        proxy = ProxyArm(env, 1, opts.ctx_per_slot, ["--min-tokens", str(opts.min_tokens)])
        async with proxy:
            for size, point in points.items():
                await _restored(client, proxy, convs[size], point, opts)
    finally:
        await client.close()
    return result


async def _conversation(client: Client, url: str, size: int) -> list[dict[str, Any]]:
    # One conversation per size; two digits, like the workload's.
    return await sized_conversation(client, url, size, 40 + size.bit_length())


async def sized_conversation(
    client: Client, url: str, size: int, conv: int
) -> list[dict[str, Any]]:
    """Conversation `conv`'s first turn at about `size` tokens: the tokens a fact costs depend
    on the tokenizer, so they are measured on the server (two probes) instead of guessed."""
    n20 = len(await client.prompt_tokens(url, first_turn(conv, 20)))
    n40 = len(await client.prompt_tokens(url, first_turn(conv, 40)))
    per_fact = (n40 - n20) / 20
    fixed = n20 - 20 * per_fact
    return first_turn(conv, max(1, round((size - fixed) / per_fact)))


def _check(point: Point, what: str, reply: Reply) -> None:
    if reply.error:
        point.errors.append(f"{what}: {reply.error}")


async def _direct(
    client: Client, url: str, messages: list[dict[str, Any]], point: Point, opts: RestoreOptions
) -> None:
    first = await client.chat(url, messages, opts.turn1_tokens)
    _check(point, "turn 1", first)
    # Each repeat asks a different question on a slot holding turn 1 as it was left: turn 1
    # again (all cached, the same reply at temperature 0) undoes the previous question, which
    # would otherwise leave a longer shared prefix than a first return has (kvproxy restores
    # the turn-1 state each time, so both arms measure a first return).
    residents = []
    for k in range(opts.repeats):
        if k:
            _check(point, "turn 1 again", await client.chat(url, messages, opts.turn1_tokens))
        reply = await client.chat(url, next_turn(messages, first.content, 2 + k), 1)
        _check(point, "resident", reply)
        residents.append(reply)
    resident = _median(residents)
    point.tokens = resident.cache_n + resident.prompt_n
    point.resident_s, point.resident_cached = resident.seconds, resident.cache_n
    returning = next_turn(messages, first.content, 2)
    again = await client.chat(url, returning, 1, cache_prompt=False)
    _check(point, "re-prefill", again)
    point.reprefill_s, point.reprefill_cached = again.seconds, again.cache_n
    progress(
        f"  {point.tokens} tokens: resident {resident.seconds * 1000:.0f} ms "
        f"({resident.cache_n} cached), re-prefill {again.seconds:.2f} s"
    )


async def _restored(
    client: Client,
    proxy: ProxyArm,
    messages: list[dict[str, Any]],
    point: Point,
    opts: RestoreOptions,
) -> None:
    first = await client.chat(proxy.url, messages, opts.turn1_tokens)
    _check(point, "turn 1 via kvproxy", first)
    before = await asyncio.to_thread(_state_files, proxy.cache_dir)
    # Another conversation takes the only slot: kvproxy saves this one to disk first.
    _check(point, "filler", await client.chat(proxy.url, FILLER, 1))
    after = await asyncio.to_thread(_state_files, proxy.cache_dir)
    saved = sorted(after.keys() - before.keys(), key=after.__getitem__)
    if not saved:
        point.errors.append("kvproxy saved no state file when the slot was taken")
        return
    state = saved[-1]
    restored = []
    for k in range(opts.repeats):
        if k:  # the slot holds this conversation again: another one takes it (saved first)
            _check(point, "filler", await client.chat(proxy.url, FILLER, 1))
        # Cold: no state file may be served from the page cache.
        await asyncio.to_thread(_drop_all, proxy.cache_dir)
        reply = await client.chat(proxy.url, next_turn(messages, first.content, 2 + k), 1)
        _check(point, "restored", reply)
        if reply.cache_state != "restored":
            point.errors.append(f"returning turn was {reply.cache_state}, not restored")
        restored.append(reply)
    reply = _median(restored)
    point.restored_s, point.restored_cached = reply.seconds, reply.cache_n
    point.restored_state = reply.cache_state
    point.restore_ms = float(reply.headers.get("X-KVProxy-Restore-Ms", 0.0))
    point.state_bytes, point.cold_read_s, point.warm_read_s = await asyncio.to_thread(
        read_times, state
    )
    progress(
        f"  {point.tokens or reply.cache_n + reply.prompt_n} tokens: {reply.cache_state} "
        f"{reply.seconds * 1000:.0f} ms ({reply.cache_n} cached), state "
        f"{point.state_bytes / 1024**2:.1f} MiB read cold in {point.cold_read_s * 1000:.1f} ms"
    )


def _median(replies: list[Reply]) -> Reply:
    return sorted(replies, key=lambda r: r.seconds)[len(replies) // 2]


def _drop_all(cache_dir: Path) -> None:
    for path in cache_dir.glob("*.kv"):
        drop_from_page_cache(path)


def _state_files(cache_dir: Path) -> dict[Path, float]:
    """State files kvproxy committed (temp names end otherwise), by modification time."""
    return {p: p.stat().st_mtime for p in cache_dir.glob("*.kv")}


def drop_from_page_cache(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages (no root needed; dirty pages are
    written first, or they would stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _drop(fd)
    finally:
        os.close(fd)


def _drop(fd: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def read_times(path: Path) -> tuple[int, float, float]:
    """The file's size, and seconds to read all of it cold, then from the page cache. Read
    through one open file: kvproxy may remove it meanwhile (a newer state superseding it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _drop(fd)
        cold = _read(fd)
        warm = _read(fd)
        return os.fstat(fd).st_size, cold, warm
    finally:
        os.close(fd)


def _read(fd: int) -> float:
    started = time.perf_counter()
    os.lseek(fd, 0, os.SEEK_SET)
    while os.read(fd, READ_CHUNK):
        pass
    return time.perf_counter() - started


def markdown(result: RestoreResult) -> str:
    rows: list[list[object]] = []
    for p in result.points:
        if not (p.tokens and p.restored_s):
            rows.append([f"~{p.target} (failed)", *([None] * 11)])
            continue
        rows.append(
            [
                p.tokens,
                f"{p.restored_s * 1000:.0f} ms",
                p.restored_cached,
                f"{p.reprefill_s:.2f} s",
                f"{p.speedup:.0f}×",
                f"{p.resident_s * 1000:.0f} ms",
                f"{p.limit_s * 1000:.0f} ms",
                f"{p.vs_limit:.2f}×",
                f"{p.state_bytes / 1024**2:.1f}",
                f"{p.cold_read_s * 1000:.1f} ms",
                f"{p.warm_read_s * 1000:.1f} ms",
                f"{p.restore_ms:.0f} ms",
            ]
        )
    cols = [
        "tokens",
        "TTFT restored (kvproxy)",
        "cached",
        "TTFT re-prefill",
        "restored vs re-prefill",
        "TTFT resident (direct)",
        "limit = resident + cold read",
        "restored / limit",
        "state MiB",
        "cold read",
        "warm read",
        "server restore call",
    ]
    text = table(cols, rows)
    errors = [f"- {p.target}: {e}" for p in result.points for e in p.errors]
    return text + ("\n\nErrors:\n" + "\n".join(errors) if errors else "")


def plot(result: RestoreResult, path: Path) -> None:
    """TTFT against conversation size, log-log: restored, re-prefilled, and the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = [p for p in result.points if p.tokens]
    x = [p.tokens for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    ax.plot(x, [p.reprefill_s for p in pts], "o-", color="tab:red", label="re-prefill (no cache)")
    ax.plot(x, [p.restored_s for p in pts], "o-", color="tab:blue", label="kvproxy, restored")
    ax.plot(
        x, [p.limit_s for p in pts], "s--", color="tab:green", label="limit: resident + cold read"
    )
    ax.plot(x, [p.resident_s for p in pts], "^:", color="tab:gray", label="resident in slot")
    ax.plot(x, [p.cold_read_s for p in pts], "v:", color="tab:olive", label="cold read of state")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(x, [f"{t:,}" for t in x])
    ax.set_xlabel("tokens in the returning conversation")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("Returning conversation: restored from disk vs re-prefilled")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
