"""Anthropic Messages (Claude Code): keyed as the server renders it, pinned by going to chat
completions, and answered byte for byte as the server's own /v1/messages would answer."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from kvproxy_bench.dialogues import system_prompt

from kvproxy import keys
from kvproxy.wire import Conversation
from kvproxy.wire.anthropic import normalize_billing_header, to_chat
from kvproxy.wire.messages import MessageJson, MessagesAdapter, MessageStream

from .conftest import RealServer, start_proxy, start_real_server

BILLING = "x-anthropic-billing-header: cc_version=2.1.3; cc_entrypoint=cli; cch={}; rest"


# --- the request, as the server converts it


def test_the_conversion_mirrors_the_servers() -> None:
    body = {
        "model": "claude",
        "system": [
            {"type": "text", "text": BILLING.format("ab12c")},
            {"type": "text", "text": "S"},
        ],
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hm", "signature": "x"},
                    {"type": "text", "text": "calling"},
                    {"type": "tool_use", "id": "t1", "name": "ls", "input": {"b": 1, "a": [2]}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "text", "text": "x"}],
                    },
                    {"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "assistant"},  # no content: dropped
        ],
        "tools": [{"name": "ls", "description": "list", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "temperature": 0,
        "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 64},
        "metadata": {"user_id": "u"},
    }
    chat = to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": BILLING.format("fffff") + "S"},
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "calling"}],
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "ls", "arguments": '{"b":1,"a":[2]}'},
                }
            ],
            "reasoning_content": "hm",
        },
        {
            "role": "user",
            "content": [{"type": "text", "text": "go on", "cache_control": {"type": "ephemeral"}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "x"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "ls", "description": "list", "parameters": {"type": "object"}},
        }
    ]
    assert chat["tool_choice"] == "required" and chat["max_tokens"] == 4096
    assert chat["temperature"] == 0 and chat["stream"] is True
    assert chat["thinking_budget_tokens"] == 64 and chat["__metadata_user_id"] == "u"
    assert "model" not in chat and "metadata" not in chat


def test_billing_header_normalised_only_when_it_has_the_servers_shape() -> None:
    assert normalize_billing_header(BILLING.format("12345")) == BILLING.format("fffff")
    assert normalize_billing_header("cch=12345; no header") == "cch=12345; no header"
    short = "x-anthropic-billing-header: cch=123"
    assert normalize_billing_header(short) == short


def conversation(body: dict[str, Any], tenant: str | None = None) -> Conversation:
    conv = MessagesAdapter().read(body, "model-a", tenant)
    assert isinstance(conv, Conversation), conv
    return conv


def test_keys_see_through_cache_control_block_shapes_and_the_billing_header() -> None:
    turn = {
        "system": [
            {"type": "text", "text": BILLING.format("aaaaa")},
            {"type": "text", "text": "sys"},
        ],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "q1", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
            {"role": "user", "content": "q2"},
        ],
        "max_tokens": 64,
    }
    # The next request moves the markers: the first message becomes a plain string, the
    # billing header changes, the last user message gains a cache_control block.
    later = {
        "system": [
            {"type": "text", "text": BILLING.format("bbbbb")},
            {"type": "text", "text": "sys"},
        ],
        "messages": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": [{"type": "text", "text": "a1"}]},
            {
                "role": "user",
                "content": [{"type": "text", "text": "q2", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "a2"}]},
            {"role": "user", "content": "q3"},
        ],
        "max_tokens": 64,
        "metadata": {"user_id": "session"},
    }
    a, b = conversation(turn), conversation(later)
    assert b.keys[: len(a.keys)] == a.keys
    other_system = {**turn, "system": "another system prompt"}
    assert conversation(other_system).keys[0] != a.keys[0]
    tools = {**turn, "tools": [{"name": "x", "input_schema": {}}]}
    assert conversation(tools).namespace != a.namespace
    assert conversation(turn, tenant="t2").namespace != a.namespace


def test_the_reply_is_keyed_as_the_client_echoes_it() -> None:
    from kvproxy.wire.capture import Reply

    reply = Reply(
        content="ok",
        tool_calls=[
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"p": "."}'}}
        ],
        finish_reason="tool_calls",
    )
    echoed = MessagesAdapter().echoed(reply)
    client_echo = {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "c1", "name": "ls", "input": {"p": "."}},
        ],
    }
    assert keys.message_bytes(echoed) == keys.message_bytes(
        to_chat({"messages": [client_echo]})["messages"][0]
    )


def test_stop_sequences_are_not_keyed() -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "stop_sequences": ["END"]}
    assert not isinstance(MessagesAdapter().read(body, "m", None), Conversation)


# --- the reply, as the server writes it (from the C++ of to_json_anthropic*)


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def chunk(
    delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any
) -> dict[str, Any]:
    choice = {"finish_reason": finish, "index": 0, "delta": delta or {}}
    return {"choices": [choice], "id": "chatcmpl-1", "model": "m", **extra}


def events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in raw.decode().split("\n\n"):
        if block:
            name, data = block.split("\n")
            out.append((name.removeprefix("event: "), orjson.loads(data.removeprefix("data: "))))
    return out


def test_a_stream_with_reasoning_text_and_a_tool_call() -> None:
    t1 = {"cache_n": 5, "prompt_n": 7, "predicted_n": 1}
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "ls"}}
    stream = [
        chunk({"role": "assistant", "content": None}),
        chunk({"reasoning_content": "Hm"}, timings=t1),
        chunk({"content": "Hi"}, timings={**t1, "predicted_n": 2}),
        chunk({"tool_calls": [call]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}, timings=t1),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        chunk(finish="tool_calls", timings={**t1, "predicted_n": 4}),
    ]
    translator = MessageStream()
    raw = sse(stream)
    # Split anywhere: the translation does not depend on how the bytes arrive.
    out = b"".join(translator.feed(raw[i : i + 7]) for i in range(0, len(raw), 7))
    out += translator.finish()
    got = events(out)
    assert [name for name, _ in got] == [
        "message_start",
        "content_block_start",  # thinking, index 0
        "content_block_delta",
        "content_block_start",  # text, index 1
        "content_block_delta",
        "content_block_start",  # tool_use, index 2
        "content_block_delta",
        # The final result's diff: the server starts its block again (its final events track
        # started blocks on their own), so kvproxy does too.
        "content_block_start",
        "content_block_delta",
        "content_block_delta",  # signature
        "content_block_stop",
        "content_block_stop",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start = got[0][1]["message"]
    assert start["usage"] == {"cache_read_input_tokens": 5, "input_tokens": 7, "output_tokens": 0}
    assert got[3][1]["index"] == 1 and got[5][1]["content_block"] == {
        "type": "tool_use",
        "id": "c1",
        "name": "ls",
    }
    assert got[5][1]["index"] == 2 and got[8][1]["delta"] == {
        "type": "input_json_delta",
        "partial_json": "1}",
    }
    assert got[13][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 4},
    }


def test_an_error_chunk_and_a_ping_pass_as_the_server_sends_them() -> None:
    t = MessageStream()
    out = t.feed(
        b":\n\n" + b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n'
    )
    assert (
        out == b':\n\nevent: error\ndata: {"code":500,"message":"boom","type":"server_error"}\n\n'
    )
    assert t.broke_off("gone") is not None and MessageJson().broke_off("gone") is None


# --- against the real server


ID = re.compile(rb'"id":"chatcmpl-[A-Za-z0-9]+"')


async def post(base: str, body: dict[str, Any]) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(base + "/v1/messages?beta=true", json=body) as r,
    ):
        return r.status, dict(r.headers), await r.read()


SHAPES: list[dict[str, Any]] = [
    {"system": "Be brief. " * 30, "messages": [{"role": "user", "content": "Say hello."}]},
    {
        "system": [
            {"type": "text", "text": BILLING.format("abcde")},
            {"type": "text", "text": "Be brief. " * 30},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": "Count to three.",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "One, two, three."}]},
            {"role": "user", "content": "Now to five, café ☕."},
        ],
    },
]


@pytest.mark.real
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("shape", range(len(SHAPES)))
async def test_answers_and_streams_are_the_servers_own(
    real_server: RealServer, cache_dir: Path, stream: bool, shape: int
) -> None:
    proxy = await start_proxy(real_server.url, cache_dir)
    try:
        body = {**SHAPES[shape], "max_tokens": 24, "temperature": 0, "stream": stream}
        # Both computed from empty slots: a prompt partly served from cache is evaluated in
        # other batches, and the server's own answer may then differ in a late token.
        await erase_slots(real_server.url)
        s_status, s_headers, direct = await post(real_server.url, body)
        await erase_slots(real_server.url)
        p_status, p_headers, proxied = await post(proxy.url, body)
    finally:
        await proxy.stop()
    assert s_status == p_status == 200
    assert p_headers["X-KVProxy-Cache"] in ("miss", "resident")
    assert p_headers["Content-Type"] == s_headers["Content-Type"]
    # What the slot already held differs between the two (that is the point of kvproxy), so
    # the split of the prompt into read-from-cache and computed may too; its size may not.
    assert prompt_sizes(direct) and prompt_sizes(proxied) == prompt_sizes(direct)
    assert same_bytes(proxied) == same_bytes(direct)


async def erase_slots(server: str) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(server + "/slots") as r:
            slots = await r.json()
        for slot in slots:
            async with s.post(f"{server}/slots/{slot['id']}?action=erase", json={}) as r:
                assert r.status == 200, await r.text()


USAGE = re.compile(rb'"cache_read_input_tokens":(\d+),"input_tokens":(\d+)')


def prompt_sizes(raw: bytes) -> list[int]:
    return [int(a) + int(b) for a, b in USAGE.findall(raw)]


def same_bytes(raw: bytes) -> bytes:
    """The reply with its random id and its cache split masked."""
    return USAGE.sub(b"USAGE", ID.sub(b"ID", raw))


def anthropic_turn(n: int) -> dict[str, Any]:
    return {
        "system": [
            {"type": "text", "text": BILLING.format(f"{n:05d}"[-5:])},
            {"type": "text", "text": system_prompt(n, 40)},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {
                        "type": "text",
                        "text": f"What does fact 3 of project {n} say?",
                        "cache_control": {"type": "ephemeral"},
                    }
                ],
            }
        ],
        "max_tokens": 12,
        "temperature": 0,
    }


def reply_blocks(raw: bytes, stream: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if not stream:
        body = orjson.loads(raw)
        return body["content"], body["usage"]
    text, usage = "", {}
    for name, data in events(raw):
        if name == "message_start":
            usage = data["message"]["usage"]
        elif name == "content_block_delta" and data["delta"]["type"] == "text_delta":
            text += data["delta"]["text"]
    return ([{"type": "text", "text": text}] if text else []), usage


def next_anthropic(
    body: dict[str, Any], blocks: list[dict[str, Any]], text: str, n: int
) -> dict[str, Any]:
    """As Claude Code does: the reply echoed as blocks, the markers moved, a new billing value."""
    messages = [dict(m) for m in body["messages"]]
    first = messages[-1]["content"]
    if isinstance(first, list):
        messages[-1] = {"role": "user", "content": first[0]["text"]}
    messages += [
        {"role": "assistant", "content": blocks},
        {
            "role": "user",
            "content": [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}],
        },
    ]
    system = [{"type": "text", "text": BILLING.format(f"{n:05d}")}, body["system"][1]]
    return {**body, "system": system, "messages": messages}


async def new_tokens(server: str, body: dict[str, Any]) -> int:
    """Tokens of this turn's prompt beyond the conversation as the client echoed it (all but
    the new user message), as the server renders and tokenises both."""

    async def tokens(messages: list[Any], generation_prompt: bool) -> list[int]:
        async with aiohttp.ClientSession() as s:
            async with s.post(
                server + "/apply-template",
                json={"messages": messages, "add_generation_prompt": generation_prompt},
            ) as r:
                prompt = (await r.json())["prompt"]
            async with s.post(
                server + "/tokenize", json={"content": prompt, "add_special": True}
            ) as r:
                return list((await r.json())["tokens"])

    messages = to_chat(body)["messages"]
    now = await tokens(messages, True)
    was = await tokens(messages[:-1], False)
    shared = next(
        (i for i, (a, b) in enumerate(zip(now, was, strict=False)) if a != b),
        min(len(now), len(was)),
    )
    return len(now) - shared


async def run_three_turns(
    proxy_url: str, server_url: str, stream: bool, between: Any
) -> list[tuple[str, dict[str, Any], int]]:
    """Turn 1, then twice: `between()` (evict or restart), the next turn. (header, usage, new)."""
    body = {**anthropic_turn(7), "stream": stream}
    status, headers, raw = await post(proxy_url, body)
    assert status == 200, raw
    out = []
    for turn in (2, 3):
        blocks, _ = reply_blocks(raw, stream)
        nxt = next_anthropic(body, blocks, f"And what does fact {turn + 3} say?", turn)
        proxy_url, server_url = await between(proxy_url, server_url)
        status, headers, raw = await post(proxy_url, nxt)
        assert status == 200, raw
        _, usage = reply_blocks(raw, stream)
        out.append((headers["X-KVProxy-Cache"], usage, await new_tokens(server_url, nxt)))
        body = nxt
    return out


def assert_warm(turns: list[tuple[str, dict[str, Any], int]]) -> None:
    for decision, usage, new in turns:
        print(
            f"messages turn: {decision} cache_read={usage['cache_read_input_tokens']} input={usage['input_tokens']} new={new}"
        )
        assert decision in ("restored", "resident"), turns
        assert usage["input_tokens"] <= new + 8, turns
        assert usage["cache_read_input_tokens"] > 500, turns


@pytest.mark.real
@pytest.mark.parametrize("stream", [False, True])
async def test_three_turns_with_evictions_between(tmp_path: Path, stream: bool) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    server = start_real_server(cache, ctx_per_slot=4096)
    proxy = await start_proxy(server.url, cache, min_tokens=64)
    try:

        async def evict(p: str, s: str) -> tuple[str, str]:
            for other in (11, 12):  # two other conversations take both slots
                status, _, raw = await post(p, {**anthropic_turn(other), "stream": stream})
                assert status == 200, raw
            return p, s

        assert_warm(await run_three_turns(proxy.url, server.url, stream, evict))
    finally:
        await proxy.stop()
        server.stop()


@pytest.mark.real
@pytest.mark.parametrize("stream", [False, True])
async def test_three_turns_with_restarts_of_both_processes_between(
    tmp_path: Path, stream: bool
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    running: dict[str, Any] = {"server": start_real_server(cache, ctx_per_slot=4096)}
    running["proxy"] = await start_proxy(running["server"].url, cache, min_tokens=64)
    try:

        async def restart(p: str, s: str) -> tuple[str, str]:
            await running["proxy"].stop()  # saves what the slots hold
            running["server"].stop()
            running["server"] = start_real_server(cache, ctx_per_slot=4096)
            running["proxy"] = await start_proxy(running["server"].url, cache, min_tokens=64)
            return running["proxy"].url, running["server"].url

        proxy_url, server_url = running["proxy"].url, running["server"].url
        assert_warm(await run_three_turns(proxy_url, server_url, stream, restart))
    finally:
        await running["proxy"].stop()
        running["server"].stop()


@pytest.mark.real
async def test_token_counting_routes_pass_through(real_server: RealServer, cache_dir: Path) -> None:
    """/v1/messages/count_tokens and /v1/responses/input_tokens touch no slot: kvproxy passes
    them through, and the client gets the server's own answer."""
    proxy = await start_proxy(real_server.url, cache_dir)
    try:
        cases = [
            ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi there"}]}),
            ("/v1/responses/input_tokens", {"input": "Hi there"}),
        ]
        async with aiohttp.ClientSession() as s:
            for path, body in cases:
                got = []
                for base in (real_server.url, proxy.url):
                    async with s.post(base + path, json=body) as r:
                        got.append((r.status, await r.json(), r.headers.get("X-KVProxy-Cache")))
                assert got[0][:2] == got[1][:2] and got[0][0] == 200, (path, got)
                assert got[1][2] is None, "passed through, not keyed"
    finally:
        await proxy.stop()
