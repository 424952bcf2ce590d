"""What every arm of `big` shares at one size: the conversations (sized on the server), each
arm's turns of them, and the requests it measures (streamed: first byte, first token)."""

from __future__ import annotations

import asyncio
from typing import Any

from kvproxy_bench.big_records import A, BigOptions, Returning, SizePoint
from kvproxy_bench.big_stream import Streamed, stream
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import next_turn
from kvproxy_bench.report import progress
from kvproxy_bench.restore import sized_conversation
from kvproxy_bench.stalls import stream_messages


class Talk:
    """One arm's conversations: what each sends next."""

    def __init__(self, first: dict[int, list[dict[str, Any]]]) -> None:
        self.next = dict(first)
        self.turns = dict.fromkeys(first, 1)

    def heard(self, conv: int, reply: str) -> None:
        self.turns[conv] += 1
        self.next[conv] = next_turn(self.next[conv], reply, self.turns[conv])


class Sized:
    """One size: the conversations every arm sends, the returning request each arm sent."""

    def __init__(self, client: Client, opts: BigOptions, point: SizePoint) -> None:
        self.client, self.opts, self.point = client, opts, point
        self.convs: dict[int, list[dict[str, Any]]] = {}
        self.returning: dict[str, list[dict[str, Any]]] = {}  # A's turn 2, per arm

    @property
    def others(self) -> list[int]:
        """The conversations that take every slot from A: one a slot."""
        return list(range(A + 1, A + 1 + self.opts.slots))

    async def sized(self, url: str) -> None:
        """A at the size, the others at theirs, measured on the first arm's server."""
        if not self.convs:
            self.convs[A] = await sized_conversation(self.client, url, self.point.size, A)
            for c in self.others:
                self.convs[c] = await sized_conversation(self.client, url, self.point.others, c)

    async def turn(
        self, url: str, talk: Talk, conv: int, max_tokens: int | None = None, arm: str = ""
    ) -> str:
        """A non-streamed turn; raises when it fails (what follows would mean nothing). A's
        first turn prices `arm`'s cold prefill."""
        reply = await self.client.chat(url, talk.next[conv], max_tokens or self.opts.max_tokens)
        if not reply.ok:
            raise RuntimeError(f"conversation {conv}, turn {talk.turns[conv]}: {reply.error}")
        prompt_ms = float(reply.timings.get("prompt_ms", 0.0))
        if arm and conv == A and talk.turns[conv] == 1 and prompt_ms:
            self.point.prefill_rates[f"{arm}, turn 1"] = reply.prompt_n / prompt_ms * 1000
        progress(
            f"  conversation {conv} turn {talk.turns[conv]}: {reply.cache_n} cached, "
            f"{reply.prompt_n} prefilled, {reply.seconds:.1f} s {reply.cache_state}"
        )
        talk.heard(conv, reply.content)
        return reply.content

    async def ask(
        self, arm: str, what: str, url: str, messages: list[dict[str, Any]], **extra: Any
    ) -> tuple[Returning, Streamed]:
        """A measured request (streamed), recorded as `what` of `arm`."""
        got = await stream(self.client.session, url, messages, self.opts.max_tokens, **extra)
        out = Returning(arm, what, got.cache_n + got.prompt_n, got.cache_n, got.ttfb_s)
        out.ttft_s, out.cache_state, out.error = got.ttft_s, got.cache_state, got.error
        out.restore_ms = got.restore_ms
        out.prompt_ms = float(got.timings.get("prompt_ms", 0.0))
        self.point.returning.append(out)
        progress(
            f"  {arm}, {what}: TTFT {got.ttft_s:.2f} s ({got.cache_n} cached, {got.prompt_n} "
            f"prefilled) {got.cache_state}" + (f" ERROR {got.error}" if got.error else "")
        )
        return out, got

    async def story(
        self, url: str, k: int, first: asyncio.Event | None = None, **extra: Any
    ) -> Streamed:
        """A short new conversation streaming `stream_tokens` tokens (`ignore_eos`)."""
        return await stream(
            self.client.session,
            url,
            stream_messages(k),
            self.opts.stream_tokens,
            first,
            ignore_eos=True,
            **extra,
        )


async def first_or_done(first: asyncio.Event, task: asyncio.Future[Any]) -> None:
    """Until the stream `task` has its first token (or has ended without one)."""
    begun = asyncio.ensure_future(first.wait())
    await asyncio.wait([task, begun], return_when=asyncio.FIRST_COMPLETED)
    begun.cancel()
