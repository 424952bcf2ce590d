"""The fake llama-server behaves like the real one in the ways kvproxy relies on."""

from __future__ import annotations

import asyncio
import json
import signal
import struct
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvproxy_fake.model import BOS, EOS, common_prefix, render_chat, tokenize
from kvproxy_fake.replies import ChatFormat, Job, Run, sse
from kvproxy_fake.server import FakeLlamaServer, FakeSlot

from kvproxy.http.session import LenientConnector
from kvproxy.server.managed import free_port

pytestmark = pytest.mark.timeout(20)

MakeServer = Callable[..., Awaitable[FakeLlamaServer]]
USER = [{"role": "user", "content": "hello there"}]
TOOLS = [{"type": "function", "function": {"name": "get_x", "parameters": {"type": "object"}}}]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    # llama-server closes a streamed reply's connection, and so does the fake: not reused.
    async with aiohttp.ClientSession(connector=LenientConnector()) as session:
        yield session


@pytest.fixture
async def make_server(tmp_path: Path) -> AsyncIterator[MakeServer]:
    servers: list[FakeLlamaServer] = []

    async def make(**kwargs: Any) -> FakeLlamaServer:
        kwargs.setdefault("slot_save_path", tmp_path)
        server = FakeLlamaServer(**kwargs)
        await server.start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        await server.stop()


@pytest.fixture
async def server(make_server: MakeServer) -> FakeLlamaServer:
    return await make_server()


async def post(
    http: aiohttp.ClientSession, server: FakeLlamaServer, path: str, body: Any = None
) -> tuple[int, Any]:
    async with http.post(server.url + path, json=body) as resp:
        return resp.status, await resp.json()


async def chat(
    http: aiohttp.ClientSession,
    server: FakeLlamaServer,
    messages: list[dict[str, Any]],
    **extra: Any,
) -> dict[str, Any]:
    status, body = await post(http, server, "/v1/chat/completions", {"messages": messages, **extra})
    assert status == 200, body
    reply: dict[str, Any] = body
    return reply


async def stream_events(
    http: aiohttp.ClientSession, server: FakeLlamaServer, path: str, body: dict[str, Any]
) -> list[tuple[float, Any]]:
    """(arrival time, parsed data or "[DONE]") for every SSE event.

    Also records in server.busy_at_event whether any slot was processing at each event.
    """
    events: list[tuple[float, Any]] = []
    busy: list[bool] = []
    async with http.post(server.url + path, json={**body, "stream": True}) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        buf = b""
        async for data in resp.content.iter_any():
            buf += data
            while b"\n\n" in buf:
                raw, buf = buf.split(b"\n\n", 1)
                assert raw.startswith(b"data: ")
                payload = raw[6:].decode()
                events.append(
                    (time.monotonic(), "[DONE]" if payload == "[DONE]" else json.loads(payload))
                )
                busy.append(any(slot.is_processing for slot in server.slots))
        assert buf == b""
    server.busy_at_event = busy  # type: ignore[attr-defined]
    return events


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.002)):
        if predicate():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition not reached")


def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
    return tokenize(render_chat(messages), add_special=True)


def reply_tokens(text: str) -> list[int]:
    return tokenize(text)


# ----------------------------------------------------------------------------- basics


async def test_tokenizer_and_template(http: aiohttp.ClientSession, server: FakeLlamaServer) -> None:
    status, body = await post(http, server, "/tokenize", {"content": "hé"})
    assert status == 200 and body == {"tokens": [ord("h") + 10, 0xC3 + 10, 0xA9 + 10]}
    _, body = await post(http, server, "/tokenize", {"content": "hi", "add_special": True})
    assert body["tokens"][0] == BOS and len(body["tokens"]) == 3
    _, body = await post(http, server, "/detokenize", {"tokens": tokenize("héllo")})
    assert body == {"content": "héllo"}

    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "reasoning_content": "hidden"},
        {"role": "user", "content": "next"},
    ]
    _, body = await post(http, server, "/apply-template", {"messages": messages})
    assert body["prompt"] == (
        "<start_of_turn>system\nsys<end_of_turn>\n"
        "<start_of_turn>user\na\nb<end_of_turn>\n"
        "<start_of_turn>model\nok<end_of_turn>\n"
        "<start_of_turn>user\nnext<end_of_turn>\n"
        "<start_of_turn>model\n"
    )
    body_no_gen = {"messages": messages, "add_generation_prompt": False}
    _, body = await post(http, server, "/apply-template", body_no_gen)
    assert body["prompt"].endswith("next<end_of_turn>\n")


async def test_info_routes_and_errors(http: aiohttp.ClientSession, server: FakeLlamaServer) -> None:
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200 and await resp.json() == {"status": "ok"}
    async with http.get(server.url + "/props") as resp:
        props = await resp.json()
    assert props["total_slots"] == 2 and props["model_path"] == "/models/fake-model.gguf"
    assert props["default_generation_settings"]["n_ctx"] == 4096
    async with http.get(server.url + "/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "fake-model.gguf"
    async with http.get(server.url + "/nowhere") as resp:
        assert resp.status == 404
        assert (await resp.json())["error"]["type"] == "not_found_error"
    async with http.get(server.url + "/slots") as resp:
        slots = await resp.json()
    assert slots == [
        {"id": i, "n_ctx": 4096, "speculative": False, "is_processing": False} for i in (0, 1)
    ]
    assert ("GET", "/slots", None) in server.requests


async def test_api_key(http: aiohttp.ClientSession, make_server: MakeServer) -> None:
    server = await make_server(api_key="sekrit")
    async with http.get(server.url + "/health") as resp:
        assert resp.status == 200
    async with http.get(server.url + "/slots") as resp:
        assert resp.status == 401
        err = (await resp.json())["error"]
        assert err == {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}
    headers = {"Authorization": "Bearer sekrit"}
    async with http.get(server.url + "/slots", headers=headers) as resp:
        assert resp.status == 200


# ----------------------------------------------------------------------------- completions


async def test_chat_reply_timings_and_slot_tokens(
    http: aiohttp.ClientSession, server: FakeLlamaServer
) -> None:
    prompt = chat_prompt(USER)
    body = await chat(http, server, USER, id_slot=1)
    msg = body["choices"][0]["message"]
    assert msg == {"role": "assistant", "content": "Echo: hello there"}
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["object"] == "chat.completion" and body["model"] == "fake-model.gguf"
    timings = body["timings"]
    assert timings["cache_n"] == 0 and timings["prompt_n"] == len(prompt)
    assert timings["predicted_n"] == len("Echo: hello there") + 1  # + EOS
    assert {"prompt_ms", "prompt_per_second", "predicted_ms", "predicted_per_second"} <= set(
        timings
    )
    assert body["usage"]["prompt_tokens"] == len(prompt)
    # the slot holds the prompt and every generated token but the last sampled one (EOS)
    assert server.slots[1].tokens == prompt + reply_tokens("Echo: hello there")
    assert server.slots[0].tokens == []

    # next turn: everything up to the reply is reused
    turn2 = [*USER, msg, {"role": "user", "content": "more"}]
    body = await chat(http, server, turn2, id_slot=1)
    common = len(prompt) + len("Echo: hello there")
    assert body["timings"]["cache_n"] == common
    assert body["timings"]["cache_n"] + body["timings"]["prompt_n"] == len(chat_prompt(turn2))
    async with http.get(server.url + "/slots") as resp:
        slot1 = (await resp.json())[1]
    assert slot1["n_prompt_tokens"] == len(server.slots[1].tokens)
    assert slot1["id_task"] == server.slots[1].id_task


async def test_same_prompt_evaluates_at_least_one_token(
    http: aiohttp.ClientSession, server: FakeLlamaServer
) -> None:
    await chat(http, server, USER, id_slot=0)
    body = await chat(http, server, USER, id_slot=0)
    assert body["timings"]["cache_n"] == len(chat_prompt(USER)) - 1
    assert body["timings"]["prompt_n"] == 1


async def test_max_tokens_limit(http: aiohttp.ClientSession, server: FakeLlamaServer) -> None:
    body = await chat(http, server, USER, id_slot=0, max_tokens=4)
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == "Echo"
    assert server.slots[0].tokens == chat_prompt(USER) + reply_tokens("Ech")


async def test_completion_n_predict_zero_holds_prompt(
    http: aiohttp.ClientSession, server: FakeLlamaServer
) -> None:
    tokens = chat_prompt(USER)
    status, body = await post(
        http, server, "/completion", {"prompt": tokens, "n_predict": 0, "id_slot": 0}
    )
    assert status == 200
    assert body["timings"]["prompt_n"] == len(tokens) and body["stop_type"] == "limit"
    assert body["id_slot"] == 0
    assert server.slots[0].tokens == tokens
    # a string prompt gets BOS like the real server
    status, body = await post(http, server, "/completion", {"prompt": "abc", "id_slot": 1})
    assert body["content"] == "Echo: <bos>abc"
    assert server.slots[1].tokens[:4] == [BOS, *tokenize("abc")]
    status, body = await post(http, server, "/v1/completions", {"prompt": "abc", "id_slot": 1})
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == "Echo: <bos>abc"
    assert body["timings"]["cache_n"] == 3


async def test_context_overflow(http: aiohttp.ClientSession, make_server: MakeServer) -> None:
    server = await make_server(n_ctx=64)
    status, body = await post(http, server, "/completion", {"prompt": "x" * 80})
    assert status == 400
    assert body["error"]["type"] == "exceed_context_size_error"
    assert body["error"]["n_prompt_tokens"] == 81 and body["error"]["n_ctx"] == 64


async def test_stream_chunks_delays_and_timings(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    server = await make_server(token_delay=0.01)
    events = await stream_events(http, server, "/v1/chat/completions", {"messages": USER})
    assert events[-1][1] == "[DONE]"
    chunks = [e for _, e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == "Echo: hello there"
    last = chunks[-1]
    assert last["choices"][0] == {"finish_reason": "stop", "index": 0, "delta": {}}
    assert last["timings"]["prompt_n"] == len(chat_prompt(USER))
    assert all("timings" not in c for c in chunks[:-1])
    times = [t for t, _ in events]
    assert times[-1] - times[0] >= 0.01 * (len("Echo: hello there") - 1)
    # content arrives while the slot decodes; the slot is idle before the final chunk is sent
    busy = server.busy_at_event  # type: ignore[attr-defined]
    assert busy[1] and not busy[-2] and not busy[-1]


async def test_stream_include_usage(http: aiohttp.ClientSession, server: FakeLlamaServer) -> None:
    body = {"messages": USER, "stream_options": {"include_usage": True}}
    events = await stream_events(http, server, "/chat/completions", body)
    last = events[-2][1]
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 18
    assert "timings" in last


async def test_tool_call(http: aiohttp.ClientSession, server: FakeLlamaServer) -> None:
    messages = [{"role": "user", "content": "please CALL_TOOL"}]
    body = await chat(http, server, messages, tools=TOOLS, id_slot=0)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_x", "arguments": '{"x": 1}'}
    again = await chat(http, server, messages, tools=TOOLS, id_slot=1)
    assert again["choices"][0]["message"]["tool_calls"][0]["id"] == call["id"]

    events = await stream_events(
        http, server, "/v1/chat/completions", {"messages": messages, "tools": TOOLS}
    )
    deltas = [e["choices"][0]["delta"] for _, e in events[:-1] if e["choices"]]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {
        "index": 0,
        "id": call["id"],
        "type": "function",
        "function": {"name": "get_x"},
    }
    assert len(calls) > 2 and all(set(c) == {"index", "function"} for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls[1:]) == '{"x": 1}'
    assert events[-2][1]["choices"][0]["finish_reason"] == "tool_calls"
    # without tools the trigger is just text
    body = await chat(http, server, messages)
    assert body["choices"][0]["message"]["content"] == "Echo: please CALL_TOOL"


async def test_thinking(http: aiohttp.ClientSession, server: FakeLlamaServer) -> None:
    kwargs = {"chat_template_kwargs": {"enable_thinking": True}}
    body = await chat(http, server, USER, id_slot=0, **kwargs)
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "Let me think." and msg["content"] == "Echo: hello there"
    # the slot holds the raw reasoning, which the template does not render on the next turn
    raw = "<think>Let me think.</think>Echo: hello there"
    assert server.slots[0].tokens == chat_prompt(USER) + reply_tokens(raw)
    turn2 = [*USER, msg, {"role": "user", "content": "more"}]
    body = await chat(http, server, turn2, id_slot=0, **kwargs)
    assert body["timings"]["cache_n"] == len(chat_prompt(USER))

    events = await stream_events(http, server, "/v1/chat/completions", {"messages": USER, **kwargs})
    deltas = [e["choices"][0]["delta"] for _, e in events[:-1] if e["choices"]]
    kinds = [k for d in deltas for k in d if k in ("reasoning_content", "content") and d[k]]
    assert kinds.index("content") > kinds.index("reasoning_content")
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Let me think."
    assert "".join(d.get("content") or "" for d in deltas) == "Echo: hello there"


async def test_custom_reply(http: aiohttp.ClientSession, make_server: MakeServer) -> None:
    server = await make_server(reply=lambda messages: f"{len(messages)} messages")
    body = await chat(http, server, USER)
    assert body["choices"][0]["message"]["content"] == "1 messages"


# ----------------------------------------------------------------------------- slot selection


async def test_id_slot_wraps(http: aiohttp.ClientSession, server: FakeLlamaServer) -> None:
    await chat(http, server, USER, id_slot=2)
    assert server.slots[0].tokens and not server.slots[1].tokens
    status, body = await post(http, server, "/slots/2?action=erase")
    assert status == 200 and body["id_slot"] == 2 and body["n_erased"] > 0
    assert server.slots[0].tokens == []
    assert server.actions[-1] == ("erase", 0, None, True)
    await chat(http, server, USER, id_slot=-1 % 2**32 + 1)  # huge ids wrap as well
    status, body = await post(http, server, "/slots/-1?action=erase")  # (size_t)-1 % 2 == 1
    assert server.actions[-1] == ("erase", 1, None, True)


async def test_server_picks_slot_by_prefix_then_lru(
    http: aiohttp.ClientSession, server: FakeLlamaServer
) -> None:
    other = [{"role": "user", "content": "something else entirely, and long enough to differ"}]
    await chat(http, server, USER)
    assert server.slots[1].tokens and not server.slots[0].tokens  # LRU tie: the last slot
    await post(http, server, "/slots/1?action=erase")
    await chat(http, server, other, id_slot=0)
    await chat(http, server, USER, id_slot=1)  # slot 1 is now the most recently used
    body = await chat(http, server, USER)  # similarity wins over LRU
    assert body["timings"]["cache_n"] == len(chat_prompt(USER)) - 1
    assert server.slots[1].id_task == max(s.id_task or 0 for s in server.slots)
    body = await chat(http, server, [{"role": "user", "content": "zzz"}])  # no match: LRU
    assert server.slots[0].id_task == max(s.id_task or 0 for s in server.slots)


async def test_busy_slot_queues_requests(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    # The first reply takes ~0.9 s: time for the second request to arrive on a loaded machine.
    server = await make_server(token_delay=0.05)
    first = asyncio.create_task(chat(http, server, USER, id_slot=0))
    await until(lambda: server.slots[0].is_processing)
    second = asyncio.create_task(chat(http, server, USER, id_slot=0))
    await until(lambda: server.deferred_tasks == 1)
    assert not second.done() and not first.done()
    r2: dict[str, Any]
    _, r2 = await asyncio.gather(first, second)
    assert r2["timings"]["cache_n"] == len(chat_prompt(USER)) - 1
    assert server.deferred_actions == 0


async def test_wipe_idle_slots(http: aiohttp.ClientSession, make_server: MakeServer) -> None:
    server = await make_server(wipe_idle_slots=True)
    await chat(http, server, USER, id_slot=0)
    assert server.slots[0].tokens
    await chat(http, server, USER, id_slot=1)
    assert server.slots[0].tokens == []
    body = await chat(http, server, USER, id_slot=0)
    assert body["timings"]["cache_n"] == 0


# ----------------------------------------------------------------------------- slot actions


async def test_save_file_format_and_restore(
    http: aiohttp.ClientSession, server: FakeLlamaServer, tmp_path: Path
) -> None:
    await chat(http, server, USER, id_slot=0)
    tokens = list(server.slots[0].tokens)
    status, body = await post(http, server, "/slots/0?action=save", {"filename": "conv.kv"})
    assert status == 200
    data = (tmp_path / "conv.kv").read_bytes()
    assert body["id_slot"] == 0 and body["filename"] == "conv.kv"
    assert body["n_saved"] == len(tokens) and body["n_written"] == len(data)
    assert "save_ms" in body["timings"]
    magic, version, n_words = struct.unpack_from("<III", data)
    assert (magic, version) == (0x67677371, 4)
    words = list(struct.unpack_from(f"<{n_words}i", data, 12))
    assert words[:3] == [-1, 1, len(tokens)] and words[3 : 3 + len(tokens)] == tokens
    assert len(data) > 12 + 4 * n_words + 16 * len(tokens) - 1

    status, body = await post(http, server, "/slots/1?action=restore", {"filename": "conv.kv"})
    assert status == 200
    assert body == {
        "id_slot": 1,
        "filename": "conv.kv",
        "n_restored": len(tokens),
        "n_read": len(data),
        "timings": body["timings"],
    }
    assert "restore_ms" in body["timings"] and server.slots[1].tokens == tokens
    async with http.get(server.url + "/slots") as resp:
        listed = await resp.json()
    # like the real server, n_prompt_tokens only shows once a task ran on the slot
    assert listed[0]["n_prompt_tokens"] == len(tokens) and "n_prompt_tokens" not in listed[1]
    assert server.actions == [("save", 0, "conv.kv", True), ("restore", 1, "conv.kv", True)]
    turn2 = [*USER, {"role": "assistant", "content": "Echo: hello there"}]
    turn2.append({"role": "user", "content": "more"})
    body = await chat(http, server, turn2, id_slot=1)
    assert body["timings"]["cache_n"] == len(tokens)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda d: None, "No available space"),  # file missing
        (lambda d: d[:40], "No available space"),  # truncated
        (lambda d: b"\0\0\0\0" + d[4:], "No available space"),  # bad magic
        (lambda d: d[:4] + struct.pack("<I", 3) + d[8:], "No available space"),  # version
        (lambda d: d[:-16], "No available space"),  # KV shorter than the tokens
    ],
)
async def test_failed_restore_erases_slot(
    http: aiohttp.ClientSession,
    server: FakeLlamaServer,
    tmp_path: Path,
    damage: Callable[[bytes], bytes | None],
    reason: str,
) -> None:
    await chat(http, server, USER, id_slot=0)
    await post(http, server, "/slots/0?action=save", {"filename": "a.kv"})
    damaged = damage((tmp_path / "a.kv").read_bytes())
    if damaged is None:
        (tmp_path / "a.kv").unlink()
    else:
        (tmp_path / "a.kv").write_bytes(damaged)
    assert server.slots[0].tokens
    status, body = await post(http, server, "/slots/0?action=restore", {"filename": "a.kv"})
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400
    assert body["error"]["message"].startswith(f"Unable to restore slot: {reason}")
    assert server.slots[0].tokens == []
    assert server.actions[-1] == ("restore", 0, "a.kv", False)


async def test_restore_larger_than_context(
    http: aiohttp.ClientSession, make_server: MakeServer, tmp_path: Path
) -> None:
    big = await make_server(n_ctx=4096)
    small = await make_server(n_ctx=32)
    await chat(http, big, USER, id_slot=0)
    await post(http, big, "/slots/0?action=save", {"filename": "big.kv"})
    status, body = await post(http, small, "/slots/0?action=restore", {"filename": "big.kv"})
    assert status == 400 and "Unable to restore slot" in body["error"]["message"]


@pytest.mark.parametrize("name", ["", "a/b", "a\\b", "..x", " a", "a ", "a.", "a:b"])
async def test_invalid_filenames(
    http: aiohttp.ClientSession, server: FakeLlamaServer, name: str
) -> None:
    for action in ("save", "restore"):
        status, body = await post(http, server, f"/slots/0?action={action}", {"filename": name})
        assert status == 400 and body["error"]["message"] == "Invalid filename"


async def test_actions_without_save_path_and_unknown_action(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    server = await make_server(slot_save_path=None)
    status, body = await post(http, server, "/slots/0?action=save", {"filename": "a"})
    assert status == 501 and body["error"]["type"] == "not_supported_error"
    server = await make_server()
    status, body = await post(http, server, "/slots/0?action=frobnicate")
    assert status == 400 and body["error"]["message"] == "Invalid action"


async def test_erase(http: aiohttp.ClientSession, server: FakeLlamaServer) -> None:
    await chat(http, server, USER, id_slot=0)
    n = len(server.slots[0].tokens)
    status, body = await post(http, server, "/slots/0?action=erase")
    assert status == 200 and body == {"id_slot": 0, "n_erased": n}
    body = await chat(http, server, USER, id_slot=0)
    assert body["timings"]["cache_n"] == 0


async def test_action_on_busy_slot_is_deferred(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    server = await make_server(token_delay=0.05)  # as above: the save arrives while it runs
    gen = asyncio.create_task(chat(http, server, USER, id_slot=0))
    await until(lambda: server.slots[0].is_processing)
    save = asyncio.create_task(post(http, server, "/slots/0?action=save", {"filename": "b.kv"}))
    await until(lambda: server.deferred_actions == 1)
    assert not save.done() and not gen.done()
    await gen
    status, body = await save
    assert status == 200
    assert body["n_saved"] == len(chat_prompt(USER)) + len("Echo: hello there")
    # an idle slot is not deferred
    await post(http, server, "/slots/1?action=erase")
    assert server.deferred_actions == 1


async def test_sidecar(
    http: aiohttp.ClientSession, make_server: MakeServer, tmp_path: Path
) -> None:
    server = await make_server(write_sidecar=True)
    await chat(http, server, USER, id_slot=0)
    await post(http, server, "/slots/0?action=save", {"filename": "s.kv"})
    sidecar = tmp_path / "s.kv.ckpt"
    assert 100 < sidecar.stat().st_size < 1000
    status, _ = await post(http, server, "/slots/1?action=restore", {"filename": "s.kv"})
    assert status == 200
    sidecar.unlink()
    status, _ = await post(http, server, "/slots/1?action=restore", {"filename": "s.kv"})
    assert status == 400 and server.slots[1].tokens == []


# ----------------------------------------------------------------------------- model classes


def _turns() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    turn1 = [{"role": "user", "content": "first question"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "Echo: first question"},
        {"role": "user", "content": "second"},
    ]
    return turn1, turn2


@pytest.mark.parametrize(
    ("reuse", "extends", "diverges"),
    [("full", True, True), ("none", False, False), ("extend", True, False)],
)
async def test_reuse_after_restore(
    http: aiohttp.ClientSession,
    make_server: MakeServer,
    reuse: str,
    extends: bool,
    diverges: bool,
) -> None:
    server = await make_server(reuse=reuse)
    turn1, turn2 = _turns()
    await chat(http, server, turn1, id_slot=0)
    held = list(server.slots[0].tokens)
    await post(http, server, "/slots/0?action=save", {"filename": "t.kv"})

    # a prompt that strictly extends every restored token
    await post(http, server, "/slots/1?action=restore", {"filename": "t.kv"})
    body = await chat(http, server, turn2, id_slot=1)
    assert body["timings"]["cache_n"] == (len(held) if extends else 0)

    # a prompt that diverges inside the restored tokens
    await post(http, server, "/slots/1?action=restore", {"filename": "t.kv"})
    other = [{"role": "user", "content": "first quest!"}]
    body = await chat(http, server, other, id_slot=1)
    common = common_prefix(held, chat_prompt(other))
    assert 0 < common < len(held)
    assert body["timings"]["cache_n"] == (common if diverges else 0)

    # without a restore in between, reuse is normal again
    body = await chat(http, server, other, id_slot=1)
    assert body["timings"]["cache_n"] == len(chat_prompt(other)) - 1


async def test_window_reuse_after_restore(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    """reuse="window" (SWA, --swa-full): restored tokens serve a divergence only within the
    last `window` of them, also after the restored state was extended."""
    server = await make_server(reuse="window")
    long = [{"role": "user", "content": "x" * 100}]
    answer = (await chat(http, server, long, id_slot=0))["choices"][0]["message"]["content"]
    held = list(server.slots[0].tokens)
    await post(http, server, "/slots/0?action=save", {"filename": "w.kv"})
    shallow = [{"role": "user", "content": "x" * 95 + "y"}]
    deep = [{"role": "user", "content": "x" * 10 + "y"}]
    common = common_prefix(held, chat_prompt(shallow))
    server.window = len(held) - common
    assert len(held) - common_prefix(held, chat_prompt(deep)) > server.window

    await post(http, server, "/slots/1?action=restore", {"filename": "w.kv"})
    assert (await chat(http, server, deep, id_slot=1))["timings"]["cache_n"] == 0

    await post(http, server, "/slots/1?action=restore", {"filename": "w.kv"})
    assert (await chat(http, server, shallow, id_slot=1))["timings"]["cache_n"] == common

    # extended after the restore: a deep divergence still finds nothing
    await post(http, server, "/slots/1?action=restore", {"filename": "w.kv"})
    more = [*long, {"role": "assistant", "content": answer}, {"role": "user", "content": "z"}]
    assert (await chat(http, server, more, id_slot=1))["timings"]["cache_n"] >= len(held)
    assert (await chat(http, server, deep, id_slot=1))["timings"]["cache_n"] == 0

    # a live slot serves any divergence
    await chat(http, server, long, id_slot=0)
    body = await chat(http, server, deep, id_slot=0)
    assert body["timings"]["cache_n"] == common_prefix(held, chat_prompt(deep))


async def test_prompt_delay(http: aiohttp.ClientSession, make_server: MakeServer) -> None:
    server = await make_server(prompt_delay=0.001)
    t0 = time.monotonic()
    body = await chat(http, server, USER, id_slot=0)
    n = len(chat_prompt(USER))
    assert time.monotonic() - t0 >= 0.001 * n
    assert body["timings"]["prompt_ms"] >= n * 1.0
    t0 = time.monotonic()
    await chat(http, server, USER, id_slot=0)
    assert time.monotonic() - t0 < 0.001 * n


async def test_client_disconnect_releases_slot(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    server = await make_server(token_delay=0.05)
    body = {"messages": USER, "stream": True, "id_slot": 0}
    async with http.post(server.url + "/v1/chat/completions", json=body) as resp:
        await resp.content.readuntil(b"\n\n")
        assert server.slots[0].is_processing
    for _ in range(100):
        if not server.slots[0].is_processing:
            break
        await asyncio.sleep(0.01)
    assert not server.slots[0].is_processing
    assert server.slots[0].tokens[: len(chat_prompt(USER))] == chat_prompt(USER)
    assert EOS not in server.slots[0].tokens


async def test_deferred_tasks_are_popped_one_per_release(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    """server_queue::pop_deferred_task: a freed slot pops ONE deferred task, preferring one
    whose id_slot names that slot; slot actions carry id_slot -1, so a deferred action for a
    busy slot can be popped, fail again, and leave a runnable completion waiting."""

    def reply(messages: list[dict[str, Any]]) -> str:
        return "x" * 40 if "long" in messages[-1]["content"] else "ok"

    server = await make_server(token_delay=0.01, reply=reply)
    a = asyncio.create_task(chat(http, server, [{"role": "user", "content": "long"}], id_slot=0))
    await until(lambda: server.slots[0].is_processing)
    b = asyncio.create_task(chat(http, server, [{"role": "user", "content": "b"}], id_slot=1))
    await until(lambda: server.slots[1].is_processing)
    erase = asyncio.create_task(post(http, server, "/slots/0?action=erase"))
    await until(lambda: server.deferred_actions == 1)
    c = asyncio.create_task(chat(http, server, [{"role": "user", "content": "c"}]))
    await until(lambda: server.deferred_tasks == 1)

    await b  # slot 1 frees: the erase is popped first, is deferred again, and c keeps waiting
    await until(lambda: server.deferred_actions == 2)
    await asyncio.sleep(0.05)
    assert not server.slots[1].is_processing and server.slots[0].is_processing
    assert not c.done() and not erase.done()

    await a  # slot 0 frees: no deferred task names slot 0, so the first one (c) runs
    await c
    assert (await erase)[0] == 200  # popped when c released its slot
    assert server.deferred_actions == 2


# ----------------------------------------------------------------------------- for benchmarks


async def test_no_slots_endpoint(http: aiohttp.ClientSession, make_server: MakeServer) -> None:
    """llama-server --no-slots: GET /slots is refused, completions still work."""
    server = await make_server(slots_endpoint=False)
    async with http.get(server.url + "/slots") as resp:
        assert resp.status == 501
        error = (await resp.json())["error"]
    assert error["type"] == "not_supported_error" and "slots endpoint" in error["message"]
    body = await chat(http, server, USER)
    assert body["choices"][0]["message"]["content"] == "Echo: hello there"


async def test_ignore_eos_runs_to_the_limit(
    http: aiohttp.ClientSession, make_server: MakeServer
) -> None:
    """llama-server --ignore-eos: EOS is never sampled; the fake says its reply again."""
    server = await make_server(ignore_eos=True, n_ctx=256)
    again = ("Echo: hello there" * 4)[:50]
    choice = (await chat(http, server, USER, max_tokens=50))["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"] == again
    events = await stream_events(
        http, server, "/v1/chat/completions", {"messages": USER, "max_tokens": 50}
    )
    chunks = [e for _, e in events[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == again
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # without a limit, until the context is full
    body = await chat(http, server, USER)
    assert body["usage"]["completion_tokens"] == 256 - len(chat_prompt(USER))


def test_plain_stream_events_are_the_parsers() -> None:
    """A reply without reasoning or tools streams through a shortcut: the same bytes, multi-byte
    characters (split over several tokens) and a broken one included."""
    reply = "héllo ✓ wörld 😀 ok"
    broken = [*tokenize("é")[:1], *tokenize("b")]  # a lead byte, then ASCII: "\ufffdb"
    job = Job(
        prompt=[BOS],
        generated=[*tokenize(reply), *broken, EOS],
        n_predict=-1,
        id_slot=-1,
        cache_prompt=True,
        stream=True,
        params={},
    )
    run = Run(slot=FakeSlot(id=0, n_ctx=4096), job=job)
    fast, parsed = (
        ChatFormat("m", "id", thinking=False, tools=False, call_id=str, include_usage=False)
        for _ in range(2)
    )
    parsed.created = fast.created
    got: list[bytes] = []
    want: list[bytes] = []
    for tok in job.generated:
        run.sampled.append(tok)
        got += fast.stream_events(run, tok)
        want += [sse(event) for event in parsed.partial(run, tok)]
    assert got == want and len(got) == 1 + len(reply) + 1  # role, one per character, "\ufffdb"
    deltas = [json.loads(event[len(b"data: ") :])["choices"][0]["delta"] for event in got]
    assert "".join(d["content"] or "" for d in deltas) == reply + "\ufffdb"
    assert fast.final_stream(run) == parsed.final_stream(run)


async def test_runs_as_a_process(http: aiohttp.ClientSession) -> None:
    """What the `overhead` benchmark starts; it stops it with SIGTERM."""
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "kvproxy_fake.server",
        *("--port", str(port), "--no-slots", "--ignore-eos"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                async with http.get(url + "/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientConnectionError:
                await asyncio.sleep(0.05)
        async with http.get(url + "/slots") as resp:
            assert resp.status == 501
        body = {"messages": USER, "max_tokens": 40}
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert (await resp.json())["usage"]["completion_tokens"] == 40
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
