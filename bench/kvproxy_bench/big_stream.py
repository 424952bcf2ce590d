"""`big`'s streamed requests: time to the first byte and to the first token of a returning
conversation, the times of a stream's tokens, and the windows in which a save or a restore ran
(to tell which gaps between tokens they caused) — the windows and gaps on plain data."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from kvproxy_bench.client import Answered
from kvproxy_bench.fleet import quantile
from kvproxy_bench.toolcalls import add_call_deltas


@dataclass
class Streamed(Answered):
    status: int
    headers: dict[str, str]
    ttfb_s: float  # the reply's head (status and headers)
    ttft_s: float  # the first event that carries a choice (the first token)
    times: list[float] = field(default_factory=list)  # perf_counter of each token's event
    content: str = ""
    # The reply's tool calls as a client assembles them from the deltas (toolcalls.py).
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    timings: dict[str, Any] = field(default_factory=dict)  # the last event's
    error: str | None = None

    @property
    def restore_ms(self) -> float:
        return float(self.headers.get("X-KVProxy-Restore-Ms", 0.0))


async def stream(
    session: aiohttp.ClientSession,
    base: str,
    messages: list[dict[str, Any]],
    max_tokens: int,
    first: asyncio.Event | None = None,
    **extra: Any,
) -> Streamed:
    """A streamed greedy chat request; `first` is set at its first token."""
    body = {
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        **extra,
    }
    started = time.perf_counter()
    out = Streamed(0, {}, 0.0, 0.0)
    try:
        # Not kept alive: llama-server alone may drop a connection after a stream.
        async with session.post(
            base + "/v1/chat/completions", json=body, headers={"Connection": "close"}
        ) as resp:
            out.status, out.headers = resp.status, dict(resp.headers)
            out.ttfb_s = time.perf_counter() - started
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
                return out
            parts = []
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                event = orjson.loads(line[6:])
                if isinstance(event.get("timings"), dict):
                    out.timings = event["timings"]
                choices = event.get("choices") or []
                if not choices:
                    continue
                if not out.times:
                    out.ttft_s = now - started
                    if first is not None:
                        first.set()
                out.times.append(now)
                delta = choices[0].get("delta") or {}
                parts.append(delta.get("content") or "")
                add_call_deltas(out.tool_calls, delta.get("tool_calls") or [])
                out.finish_reason = choices[0].get("finish_reason") or out.finish_reason
            out.content = "".join(parts)
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    return out


@dataclass
class Window:
    what: str  # "save" | "restore"
    started: float  # perf_counter
    ended: float


class ActionWatch:
    """Polls kvproxy's /kvproxy/stats (answered by kvproxy alone, without the server) for
    slots whose action is a save or a restore, and keeps each as a window."""

    def __init__(self, session: aiohttp.ClientSession, url: str, interval: float = 0.1) -> None:
        self.session, self.url, self.interval = session, url, interval
        self.windows: list[Window] = []
        self._open: dict[tuple[int, str], float] = {}
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> list[Window]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        now = time.perf_counter()
        for (_, what), began in self._open.items():
            self.windows.append(Window(what, began, now))
        self._open.clear()
        return self.windows

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                async with self.session.get(self.url + "/kvproxy/stats") as resp:
                    slots = (await resp.json()).get("slots") or []
                self._seen(slots, time.perf_counter())
            await asyncio.sleep(self.interval)

    def _seen(self, slots: list[dict[str, Any]], now: float) -> None:
        acting = {
            (int(s.get("id", 0)), str(s["action"]).split()[0])
            for s in slots
            if s.get("action") and str(s["action"]).split()[0] in ("saving", "restoring")
        }
        for key in acting - self._open.keys():
            self._open[key] = now
        for key in self._open.keys() - acting:
            what = "save" if key[1] == "saving" else "restore"
            self.windows.append(Window(what, self._open.pop(key), now))


def gaps_ms(times: list[float]) -> list[float]:
    return [(b - a) * 1000 for a, b in itertools.pairwise(times)]


def gaps_in(times: list[float], windows: list[Window], what: str) -> list[float]:
    """The gaps (ms) between tokens that overlap a window of kind `what`."""
    out = []
    for a, b in itertools.pairwise(times):
        if any(w.what == what and a < w.ended and b > w.started for w in windows):
            out.append((b - a) * 1000)
    return out


def p99(values: list[float]) -> float | None:
    return quantile(values, 0.99)


def p50(values: list[float]) -> float | None:
    return quantile(values, 0.5)
