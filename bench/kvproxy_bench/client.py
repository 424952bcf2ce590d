"""The benchmark's HTTP client: chat requests with their server-side timings, and the token
counts behind "ideal prefill" (rendered with /apply-template, counted with /tokenize)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from kvproxy.http.session import LenientConnector


class Answered:
    """What a reply tells, streamed or not: its status, the server's `timings`, kvproxy's
    X-KVProxy-Cache header."""

    status: int
    headers: dict[str, str]
    timings: dict[str, Any]
    error: str | None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    @property
    def cache_n(self) -> int:
        return int(self.timings.get("cache_n", 0))

    @property
    def prompt_n(self) -> int:
        return int(self.timings.get("prompt_n", 0))

    @property
    def cache_state(self) -> str:
        return self.headers.get("X-KVProxy-Cache", "-")


@dataclass
class Reply(Answered):
    status: int
    body: dict[str, Any]
    headers: dict[str, str]
    seconds: float  # wall time of the whole request, client side
    error: str | None = None
    timings: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        found = self.body.get("timings") if isinstance(self.body, dict) else None
        self.timings = found if isinstance(found, dict) else {}

    @property
    def server_ms(self) -> float:
        """Time the server spent on the prompt and the reply (not queueing, not restoring)."""
        return float(self.timings.get("prompt_ms", 0.0)) + float(
            self.timings.get("predicted_ms", 0.0)
        )

    @property
    def content(self) -> str:
        try:
            return str(self.body["choices"][0]["message"]["content"] or "")
        except (KeyError, IndexError, TypeError):
            return ""


@dataclass
class Client:
    """One session per benchmark: connection set-up is not what we measure. Its connections
    are kvproxy's own (LenientConnector): not reused after a streamed reply, which llama-server
    follows by closing the connection."""

    session: aiohttp.ClientSession = field(
        default_factory=lambda: aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=30),
            connector=LenientConnector(),
        )
    )

    async def close(self) -> None:
        await self.session.close()

    async def chat(
        self, base: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any
    ) -> Reply:
        """Non-streamed, greedy: the reply carries `timings` (cache_n, prompt_n, prompt_ms)."""
        body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens, **extra}
        started = time.perf_counter()
        try:
            async with self.session.post(base + "/v1/chat/completions", json=body) as resp:
                raw = await resp.read()
                seconds = time.perf_counter() - started
                try:
                    parsed = await resp.json(content_type=None) if raw else {}
                except ValueError:
                    parsed = {"raw": raw[:300].decode("utf-8", "replace")}
                error = None if resp.status == 200 else f"HTTP {resp.status}: {str(parsed)[:200]}"
                return Reply(resp.status, parsed, dict(resp.headers), seconds, error)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            seconds = time.perf_counter() - started
            return Reply(0, {}, {}, seconds, f"{type(exc).__name__}: {exc}")

    async def stream_times(
        self,
        base: str,
        messages: list[dict[str, Any]],
        max_tokens: int,
        first: asyncio.Event | None = None,
        **extra: Any,
    ) -> list[float]:
        """Streamed, greedy: `time.perf_counter()` at each event that carries reply text (one
        per token on llama-server); `first` is set at the first. Raises on an error status."""
        body = {
            "messages": messages,
            "temperature": 0,
            "max_tokens": max_tokens,
            "stream": True,
            **extra,
        }
        times: list[float] = []
        # Not kept alive: llama-server alone may drop a connection after a stream, and the
        # next request on it would fail.
        close = {"Connection": "close"}
        async with self.session.post(
            base + "/v1/chat/completions", json=body, headers=close
        ) as resp:
            resp.raise_for_status()
            async for line in resp.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter()
                choices = orjson.loads(line[6:]).get("choices") or [{}]
                if (choices[0].get("delta") or {}).get("content"):
                    times.append(now)
                    if first is not None:
                        first.set()
        return times

    async def post_json(self, url: str, body: dict[str, Any]) -> Any:
        async with self.session.post(url, json=body) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def get_json(self, url: str) -> Any:
        async with self.session.get(url) as resp:
            resp.raise_for_status()
            return await resp.json()

    async def prompt_tokens(
        self,
        base: str,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **template: Any,
    ) -> list[int]:
        """The tokens the server evaluates for `messages` (and the request fields the template
        reads, `template`: tools…): the chat template rendered by the server, tokenised with
        `add_special` as the server tokenises prompts (BOS included)."""
        body = {**template, "messages": messages, "add_generation_prompt": add_generation_prompt}
        rendered = await self.post_json(base + "/apply-template", body)
        # A router routes every POST by its "model": the tokenising goes to the same one.
        named = {"model": template["model"]} if "model" in template else {}
        tokens = await self.post_json(
            base + "/tokenize", {**named, "content": rendered["prompt"], "add_special": True}
        )
        return [int(t) for t in tokens["tokens"]]
