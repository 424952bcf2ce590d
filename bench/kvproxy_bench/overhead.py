"""`overhead`: kvproxy's own cost against the direct path, on the fake llama-server
(`kvproxy_fake.server`, no prompt or token delays: it answers at once), in three modes:
cache on (the fake answers `/slots`, so every chat request is keyed and pinned; the same
request each time, and an agent's turns: each request the last one, its reply and a new
message) and pass-through (`--no-slots`: `/slots` answers 501, as a server
without slots would: kvproxy relays uncached). Slot save/restore answer 501 (no
`--slot-save-path`): these runs never touch the disk.

The fake server and kvproxy run as separate processes; the client is this process. The same
client sends every request, alternating direct and proxied, one at a time, so its own cost
and the machine's drift fall on both paths equally: added latency = proxied − direct, at the
same percentile.

- small non-streamed chat requests: latency p50/p99, direct and proxied, and through the
  floor of any aiohttp proxy (`kvproxy_bench.minimal_proxy`, a minimal pass-through, its own
  process, in the same rotation);
- SSE relay: one streamed reply of `sse_events` events, events per second at the client;
- time to first byte of a streamed reply;
- the time to key a 1 MB, 500-message conversation in-process: JSON parsing, namespace and
  the chained hashes over every message (what kvproxy does per chat request).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
import orjson

from kvproxy import keys as keymod
from kvproxy.http.session import LenientConnector
from kvproxy.server.managed import free_port
from kvproxy_bench.arms import BenchEnv
from kvproxy_bench.process import LoggedProcess
from kvproxy_bench.report import progress, table

CACHE_ON = "cache on"
# Cache on, each request an agent's next turn: the last one, its reply and a new message.
AGENT_TURNS = "cache on, agent turns"
PASS_THROUGH = "pass-through"
TURNS_A_CONVERSATION = 16  # then a new conversation (a new session: kvproxy's cold path)
JSON_HEADERS = {"Content-Type": "application/json"}
FAKE_MIN_CTX = 4096  # the fake's context per slot, unless a stream needs more


@dataclass
class OverheadOptions:
    requests: int = 2000  # small non-streamed requests per path and mode
    sse_events: int = 20000
    sse_runs: int = 3
    ttfb_requests: int = 300
    key_bytes: int = 1_000_000
    key_messages: int = 500
    key_runs: int = 30
    modes: tuple[str, ...] = (CACHE_ON, AGENT_TURNS, PASS_THROUGH)


@dataclass
class ModeResult:
    mode: str
    direct_ms: list[float] = field(default_factory=list)
    proxied_ms: list[float] = field(default_factory=list)
    floor_ms: list[float] = field(default_factory=list)  # the minimal aiohttp pass-through
    # CPU time (user + system) per small request of each proxy process: what its hop costs
    # the machine, which a loaded machine's scheduling does not blur as it does latency.
    proxy_cpu_us: float = 0.0
    floor_cpu_us: float = 0.0
    sse_direct_eps: float = 0.0
    sse_proxied_eps: float = 0.0
    ttfb_direct_ms: list[float] = field(default_factory=list)
    ttfb_proxied_ms: list[float] = field(default_factory=list)
    errors: int = 0

    def summary(self) -> dict[str, float]:
        d, p = self.direct_ms, self.proxied_ms
        td, tp = self.ttfb_direct_ms, self.ttfb_proxied_ms
        return {
            "direct_p50_ms": percentile(d, 50),
            "direct_p99_ms": percentile(d, 99),
            "proxied_p50_ms": percentile(p, 50),
            "proxied_p99_ms": percentile(p, 99),
            "added_p50_ms": percentile(p, 50) - percentile(d, 50),
            "added_p99_ms": percentile(p, 99) - percentile(d, 99),
            "floor_p50_ms": percentile(self.floor_ms, 50),
            "floor_p99_ms": percentile(self.floor_ms, 99),
            "floor_added_p50_ms": percentile(self.floor_ms, 50) - percentile(d, 50),
            "floor_added_p99_ms": percentile(self.floor_ms, 99) - percentile(d, 99),
            "above_floor_p50_ms": percentile(p, 50) - percentile(self.floor_ms, 50),
            "above_floor_p99_ms": percentile(p, 99) - percentile(self.floor_ms, 99),
            "sse_direct_eps": self.sse_direct_eps,
            "sse_proxied_eps": self.sse_proxied_eps,
            "ttfb_direct_p50_ms": percentile(td, 50),
            "ttfb_proxied_p50_ms": percentile(tp, 50),
            "ttfb_added_p50_ms": percentile(tp, 50) - percentile(td, 50),
        }


@dataclass
class OverheadResult:
    options: dict[str, Any]
    modes: list[ModeResult] = field(default_factory=list)
    key_ms: list[float] = field(default_factory=list)
    key_body_bytes: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "modes": {
                m.mode: {
                    **m.summary(),
                    "errors": m.errors,
                    "proxy_cpu_us": m.proxy_cpu_us,
                    "floor_cpu_us": m.floor_cpu_us,
                }
                for m in self.modes
            },
            "key_ms_median": statistics.median(self.key_ms) if self.key_ms else None,
            "key_ms_max": max(self.key_ms, default=None),
            "key_body_bytes": self.key_body_bytes,
        }


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def _wait_up(session: aiohttp.ClientSession, url: str, proc: LoggedProcess) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.exited is not None:
            raise RuntimeError(f"a helper process exited ({proc.exited}); see {proc.log_path}")
        with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
            async with session.get(url) as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up; see {proc.log_path}")


async def run_overhead(env: BenchEnv, opts: OverheadOptions) -> OverheadResult:
    result = OverheadResult(options=asdict(opts))
    for mode in opts.modes:
        progress(f"overhead: {mode}")
        result.modes.append(await _run_mode(env, opts, mode))
    progress("overhead: keys for a 1 MB conversation")
    result.key_body_bytes, result.key_ms = await asyncio.to_thread(time_keys, opts)
    return result


async def _run_mode(env: BenchEnv, opts: OverheadOptions, mode: str) -> ModeResult:
    workdir = env.new_dir(f"overhead-{mode.replace(' ', '-')}")
    await asyncio.to_thread(workdir.mkdir, 0o700, True, True)
    fake_port, proxy_port = free_port(), free_port()
    fake_command = [
        sys.executable,
        "-m",
        "kvproxy_fake.server",
        "--port",
        str(fake_port),
        # Streams of exactly `sse_events` tokens: no EOS, and room for them in the context.
        "--ignore-eos",
        "--ctx-size",
        str(max(FAKE_MIN_CTX, opts.sse_events + 1024)),
        "--no-slots" if mode == PASS_THROUGH else "--slots",
    ]
    fake = LoggedProcess(workdir / "fake.log")
    direct = f"http://127.0.0.1:{fake_port}"
    proxy_command = [
        sys.executable,
        "-m",
        "kvproxy.cli",
        "serve",
        "--upstream",
        direct,
        "--port",
        str(proxy_port),
        "--cache-dir",
        str(workdir / "cache"),
    ]
    proxy = LoggedProcess(workdir / "kvproxy.log")
    proxied = f"http://127.0.0.1:{proxy_port}"
    floor_port = free_port()
    floor_command = [sys.executable, "-m", "kvproxy_bench.minimal_proxy"]
    floor_command += ["--port", str(floor_port), "--upstream", direct]
    floor = LoggedProcess(workdir / "minimal-proxy.log")
    floored = f"http://127.0.0.1:{floor_port}"
    out = ModeResult(mode)
    # Not reused after a streamed reply: llama-server closes the connection then.
    session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=120), connector=LenientConnector()
    )
    try:
        await fake.start(fake_command)
        await _wait_up(session, direct + "/health", fake)
        await proxy.start(proxy_command)
        await _wait_up(session, proxied + "/kvproxy/stats", proxy)
        await floor.start(floor_command)
        await _wait_up(session, floored + "/health", floor)
        arms = [
            (direct, out.direct_ms, Dialogue(mode)),
            (proxied, out.proxied_ms, Dialogue(mode)),
            (floored, out.floor_ms, Dialogue(mode)),
        ]
        for _ in range(50):  # warm up connections, caches and the proxies' code paths
            for base, _times, dialogue in arms:
                await _small(session, base, dialogue, out)
        out.errors = 0
        cpu = [_cpu_s(p) for p in (proxy, floor)]
        for i in range(opts.requests):
            # Each arm goes first, second and last in turn: none always follows the same one.
            for base, times, dialogue in arms[i % 3 :] + arms[: i % 3]:
                times.append(await _small(session, base, dialogue, out))
        per = 1e6 / max(opts.requests, 1)
        out.proxy_cpu_us = (_cpu_s(proxy) - cpu[0]) * per
        out.floor_cpu_us = (_cpu_s(floor) - cpu[1]) * per
        progress(
            f"  small requests: direct p50 {percentile(out.direct_ms, 50):.2f} ms, "
            f"proxied p50 {percentile(out.proxied_ms, 50):.2f} ms, "
            f"minimal aiohttp p50 {percentile(out.floor_ms, 50):.2f} ms"
        )
        direct_eps, proxied_eps = [], []
        for _ in range(opts.sse_runs):
            direct_eps.append(await _sse_rate(session, direct, opts.sse_events, out))
            proxied_eps.append(await _sse_rate(session, proxied, opts.sse_events, out))
        out.sse_direct_eps = statistics.median(direct_eps)
        out.sse_proxied_eps = statistics.median(proxied_eps)
        progress(f"  SSE: direct {out.sse_direct_eps:,.0f}/s, proxied {out.sse_proxied_eps:,.0f}/s")
        for _ in range(opts.ttfb_requests):
            out.ttfb_direct_ms.append(await _ttfb(session, direct, out))
            out.ttfb_proxied_ms.append(await _ttfb(session, proxied, out))
    finally:
        await session.close()
        await floor.stop(grace=30)
        await proxy.stop(grace=30)
        await fake.stop(grace=30)
    return out


def _cpu_s(proc: LoggedProcess) -> float:
    """CPU seconds (user + system) the process has used so far (Linux /proc)."""
    if proc.process is None:
        return 0.0
    try:
        with open(f"/proc/{proc.process.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Dialogue:
    """One path's small requests: the same two messages each time, or (agent turns) each
    request the last one, its reply and a new message, a new conversation every
    `TURNS_A_CONVERSATION` turns. Every path gets the same requests."""

    def __init__(self, mode: str) -> None:
        self.turns = mode == AGENT_TURNS
        self.conversations = 0
        self.messages = self._opening()

    def _opening(self) -> list[dict[str, Any]]:
        self.conversations += 1
        return [
            {"role": "system", "content": "You are a benchmark."},
            {"role": "user", "content": f"Say ok ({self.conversations})."},
        ]

    def body(self) -> bytes:
        return orjson.dumps({"messages": self.messages, "max_tokens": 8, "temperature": 0})

    def replied(self, reply: bytes) -> None:
        if not self.turns:
            return
        if len(self.messages) >= 2 * TURNS_A_CONVERSATION:
            self.messages = self._opening()
            return
        text = orjson.loads(reply)["choices"][0]["message"]["content"]
        turn = len(self.messages) // 2
        self.messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": f"Tool result {turn}: ok."},
        ]


async def _small(
    session: aiohttp.ClientSession, base: str, dialogue: Dialogue, out: ModeResult
) -> float:
    body = dialogue.body()
    started = time.perf_counter()
    async with session.post(base + "/v1/chat/completions", data=body, headers=JSON_HEADERS) as r:
        reply = await r.read()
        elapsed = (time.perf_counter() - started) * 1000
        if r.status != 200:
            out.errors += 1
            return elapsed
    dialogue.replied(reply)
    return elapsed


def _stream_body(n: int) -> bytes:
    return orjson.dumps(
        {"messages": [{"role": "user", "content": "Stream."}], "max_tokens": n, "stream": True}
    )


async def _sse_rate(
    session: aiohttp.ClientSession, base: str, n_events: int, out: ModeResult
) -> float:
    body = _stream_body(n_events)
    events = 0
    tail = b""
    started = time.perf_counter()
    async with session.post(base + "/v1/chat/completions", data=body, headers=JSON_HEADERS) as r:
        async for chunk in r.content.iter_any():
            # An event ends with a blank line; the separator may straddle two chunks.
            events += (tail + chunk).count(b"\n\n") - tail.count(b"\n\n")
            tail = chunk[-1:]
        if r.status != 200:
            out.errors += 1
    seconds = time.perf_counter() - started
    return events / seconds


async def _ttfb(session: aiohttp.ClientSession, base: str, out: ModeResult) -> float:
    body = _stream_body(4)
    started = time.perf_counter()
    async with session.post(base + "/v1/chat/completions", data=body, headers=JSON_HEADERS) as r:
        await r.content.readany()
        first = time.perf_counter() - started
        await r.read()
        if r.status != 200:
            out.errors += 1
    return first * 1000


def conversation_body(total_bytes: int, n_messages: int) -> bytes:
    """A chat request of about `total_bytes` with `n_messages` alternating messages."""
    rng = random.Random(5)
    words = ["kv", "cache", "slot", "token", "prefill", "restore", "proxy", "server", "llama"]
    per = max(1, total_bytes // n_messages)
    messages = []
    for i in range(n_messages):
        text = ""
        while len(text) < per:
            text += rng.choice(words) + " "
        role = "system" if i == 0 else ("user" if i % 2 else "assistant")
        messages.append({"role": role, "content": text[:per]})
    return orjson.dumps({"messages": messages, "max_tokens": 16, "temperature": 0})


def time_keys(opts: OverheadOptions) -> tuple[int, list[float]]:
    """What kvproxy computes per chat request before it picks a slot, timed in-process."""
    body = conversation_body(opts.key_bytes, opts.key_messages)
    times = []
    for _ in range(opts.key_runs):
        started = time.perf_counter()
        payload = orjson.loads(body)
        ns = keymod.namespace("bench-model", payload, None)
        keymod.chain(ns, payload["messages"])
        times.append((time.perf_counter() - started) * 1000)
    return len(body), times


def markdown(result: OverheadResult) -> str:
    rows = []
    for m in result.modes:
        s = m.summary()
        rows.append(
            [
                m.mode,
                f"{s['direct_p50_ms']:.2f} / {s['direct_p99_ms']:.2f}",
                f"{s['proxied_p50_ms']:.2f} / {s['proxied_p99_ms']:.2f}",
                f"{s['added_p50_ms']:.2f} / {s['added_p99_ms']:.2f}",
                f"{s['sse_direct_eps']:,.0f}",
                f"{s['sse_proxied_eps']:,.0f}",
                f"{s['ttfb_direct_p50_ms']:.2f}",
                f"{s['ttfb_proxied_p50_ms']:.2f}",
                m.errors,
            ]
        )
    cols = [
        "mode",
        "direct p50 / p99 (ms)",
        "proxied p50 / p99 (ms)",
        "added p50 / p99 (ms)",
        "SSE direct (events/s)",
        "SSE proxied (events/s)",
        "TTFB direct p50 (ms)",
        "TTFB proxied p50 (ms)",
        "errors",
    ]
    floor_rows = [
        [
            m.mode,
            f"{s['added_p50_ms']:.2f} / {s['added_p99_ms']:.2f}",
            f"{s['floor_added_p50_ms']:.2f} / {s['floor_added_p99_ms']:.2f}",
            f"{s['above_floor_p50_ms']:+.2f} / {s['above_floor_p99_ms']:+.2f}",
            f"{m.proxy_cpu_us:,.0f} / {m.floor_cpu_us:,.0f}",
        ]
        for m in result.modes
        if m.floor_ms
        for s in [m.summary()]
    ]
    floor = ""
    if floor_rows:
        floor_cols = [
            "mode",
            "kvproxy added p50 / p99 (ms)",
            "minimal aiohttp pass-through added p50 / p99 (ms)",
            "kvproxy above it p50 / p99 (ms)",
            "CPU per request, kvproxy / minimal (µs)",
        ]
        floor = "\n\nThe floor, in the same rotation:\n\n" + table(floor_cols, floor_rows)
    keys = ""
    if result.key_ms:
        keys = (
            f"\n\nKeys for a {result.key_body_bytes / 1e6:.2f} MB, "
            f"{result.options['key_messages']}-message conversation (JSON parsing included): "
            f"median {statistics.median(result.key_ms):.2f} ms, max {max(result.key_ms):.2f} ms "
            f"over {len(result.key_ms)} runs."
        )
    return table(cols, rows) + floor + keys
