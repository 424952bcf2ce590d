"""Saves and tool loops against the fake llama-server: a save a request needs waits for the
other slots' streams (at most --save-wait); a conversation waiting for a tool's result keeps
its slot against a newcomer, and when it had to leave it, is restored into the next slot that
frees before its result comes (a prefetch)."""

from __future__ import annotations

import asyncio
from typing import Any

from .conftest import Maker
from .test_cache import chat, conv, prompt_tokens, settle, then
from .test_warm import save_posts, slot_of, until

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>{"name": "read_file", "arguments": {"path": "a.txt"}}</tool_call>'


def replies(messages: list[dict[str, Any]]) -> str:
    """A long reply for "stream", a tool call for "call a tool", else an echo."""
    text = str([m for m in messages if m["role"] == "user"][-1]["content"])
    if "stream" in text:
        return "word " * 150
    if "call a tool" in text:
        return CALL
    return "Echo: " + text[:40]


def tool_turn(n: int) -> list[dict[str, Any]]:
    return [*conv(n)[:1], {"role": "user", "content": f"first question {n}: call a tool"}]


def result_of(messages: list[dict[str, Any]], reply: dict[str, Any]) -> list[dict[str, Any]]:
    msg = reply["choices"][0]["message"]
    call = msg["tool_calls"][0]
    echoed = {"role": "assistant", "content": msg.get("content"), "tool_calls": [call]}
    return [*messages, echoed, {"role": "tool", "tool_call_id": call["id"], "content": "hello"}]


async def stream_while(make_stream: Any, proxy: Any) -> asyncio.Future[Any]:
    streaming: asyncio.Future[Any] = asyncio.ensure_future(make_stream)
    await until(lambda: any(s.working for s in proxy.cache.pool.slots))
    return streaming


async def newcomer_during_a_stream(make: Maker, wait: float) -> tuple[bool, bool]:
    """Two slots: conversation 1 idle on one (not saved), a long reply streaming on the other;
    a newcomer must save 1 first. (Was the save sent while the stream ran; did the newcomer
    get its reply)."""
    fake, proxy = await make(
        server={"token_delay": 0.02, "reply": replies}, save_wait=wait, live_window=0
    )
    await chat(proxy, conv(1))
    await settle(proxy)
    home = slot_of(proxy, 1)
    stream = [*conv(2)[:1], {"role": "user", "content": "stream a long reply"}]
    streaming = await stream_while(chat(proxy, stream), proxy)
    newcomer = asyncio.ensure_future(chat(proxy, conv(3)))
    await until(lambda: proxy.cache.pool.slots[home].gated or save_posts(fake, home) > 0)
    await asyncio.sleep(1.0)  # well past its wait when that is short
    sent_during = save_posts(fake, home) > 0 and not streaming.done()
    status, _, _ = await streaming
    assert status == 200
    status, _, h = await newcomer
    await settle(proxy)
    return sent_during, status == 200 and h["X-KVProxy-Cache"] == "miss"


async def test_a_save_a_request_needs_waits_for_another_slots_stream(make: Maker) -> None:
    sent_during, served = await newcomer_during_a_stream(make, wait=60)
    assert not sent_during and served


async def test_a_save_a_request_needs_waits_at_most_save_wait(make: Maker) -> None:
    sent_during, served = await newcomer_during_a_stream(make, wait=0.2)
    assert sent_during and served


async def test_a_tool_loop_keeps_its_slot_against_a_newcomer(make: Maker) -> None:
    """Slot of conversation 1 (a tool call just answered) is the least recently used one; the
    newcomer takes the other (saving what it held first), and 1's result finds its state."""
    fake, proxy = await make(server={"reply": replies}, live_window=0)
    _, tool_reply, _ = await chat(proxy, tool_turn(1), tools=TOOLS)
    assert tool_reply["choices"][0]["finish_reason"] == "tool_calls"
    home = slot_of(proxy, 1)
    _, two, _ = await chat(proxy, conv(2))
    await settle(proxy)
    status, _, _ = await chat(proxy, conv(3))
    assert status == 200
    assert slot_of(proxy, 1) == home  # 2's slot went to 3, saved first
    status, body, h = await chat(proxy, result_of(tool_turn(1), tool_reply), tools=TOOLS)
    assert status == 200 and h["X-KVProxy-Cache"] == "resident"
    assert body["timings"]["cache_n"] >= prompt_tokens(tool_reply)
    status, _, h = await chat(proxy, then(conv(2), two))
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"


async def test_without_the_rule_the_newcomer_takes_the_tool_loops_slot(make: Maker) -> None:
    fake, proxy = await make(server={"reply": replies}, live_window=0, tool_result_within=0)
    _, tool_reply, _ = await chat(proxy, tool_turn(1), tools=TOOLS)
    await chat(proxy, conv(2))
    await settle(proxy)
    await chat(proxy, conv(3))
    await settle(proxy)
    status, _, h = await chat(proxy, result_of(tool_turn(1), tool_reply), tools=TOOLS)
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"


async def test_a_tool_loop_that_lost_its_slot_is_prefetched_into_the_next_one_that_frees(
    make: Maker,
) -> None:
    """Both slots wait for tool results when a newcomer comes: it takes the least recently
    used (1's, saved first). Once its reply is done, 1 is restored into that slot before its
    result comes, and the result finds its state resident."""
    fake, proxy = await make(server={"reply": replies}, live_window=0)
    _, one, _ = await chat(proxy, tool_turn(1), tools=TOOLS)
    _, two, _ = await chat(proxy, tool_turn(2), tools=TOOLS)
    await settle(proxy)
    home = slot_of(proxy, 1)
    status, _, _ = await chat(proxy, conv(3))
    assert status == 200
    await until(lambda: proxy.stats()["prefetches"] == 1)
    await settle(proxy)
    back = proxy.cache.pool.slots[home].holding
    assert back is not None and back.restored_depth > 0  # 1 is back where it was, restored
    status, body, h = await chat(proxy, result_of(tool_turn(1), one), tools=TOOLS)
    assert status == 200 and h["X-KVProxy-Cache"] == "resident"
    assert body["timings"]["cache_n"] >= prompt_tokens(one)
    status, _, h = await chat(proxy, result_of(tool_turn(2), two), tools=TOOLS)
    assert status == 200 and h["X-KVProxy-Cache"] == "resident"
