"""OpenAI Responses (`/v1/responses`, Codex): the mirror of llama-server's conversion to chat,
the keys, the captured reply and its echo; then, against a real llama-server (Gemma 3 270M,
-np 2, --cache-ram 0, --swa-full), Codex-shaped conversations that come back resident or
from disk after evictions and restarts, and never prefill more than the server alone does.

`pytest tests/test_responses.py -s` prints the measured numbers.
"""

from __future__ import annotations

import copy
import logging
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from kvproxy_bench.dialogues import system_prompt

from kvproxy import keys
from kvproxy.edge.app import SERVICE
from kvproxy.edge.routes import Treatment
from kvproxy.wire import Conversation, NotKeyed
from kvproxy.wire.capture import Reply
from kvproxy.wire.responses import (
    NotConvertible,
    ResponsesAdapter,
    ResponsesCapture,
    parse_response,
    to_chat,
)

from .conftest import RealServer, RunningProxy, committed, start_proxy, start_real_server

MODEL = "model-identity"
ADAPTER = ResponsesAdapter()

SHELL_PARAMS = {
    "type": "object",
    "properties": {"command": {"type": "array", "items": {"type": "string"}}},
    "required": ["command"],
}
SHELL = {
    "type": "function",
    "name": "shell",
    "description": "Runs a shell command and returns its output.",
    "strict": False,
    "parameters": SHELL_PARAMS,
}
PLAN = {
    "type": "function",
    "name": "update_plan",
    "description": "Updates the task plan.",
    "parameters": {"type": "object", "properties": {"plan": {"type": "string"}}},
}
TOOLS = [SHELL, PLAN, {"type": "web_search"}]


def codex_body(**extra: Any) -> dict[str, Any]:
    """A body shaped like Codex's (written from the public API, not captured)."""
    return {
        "model": "gpt-5-codex",
        "instructions": "You are Codex, a coding agent.",
        "input": [
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "<permissions>workspace</permissions>"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [
                    {
                        "type": "input_text",
                        "text": "<environment_context>cwd=/w</environment_context>",
                    },
                    {"type": "input_text", "text": "List the files."},
                ],
            },
        ],
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "reasoning": {"effort": "low", "summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a7c3-session",
        "client_metadata": {"turn_id": "t-1", "sent_at": "2026-01-01T10:00:00Z"},
        **extra,
    }


# --- the conversion, against what server_chat_convert_responses_to_chatcmpl does


def test_codex_body_converts_as_the_server_converts_it() -> None:
    body = codex_body(max_output_tokens=64)
    body["input"] += [
        {
            "type": "reasoning",
            "id": "rs_1",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Look first."}],
            "encrypted_content": "",
        },
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Listing.", "annotations": []}],
        },
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "call_1",
            "name": "shell",
            "arguments": '{"command":["ls"]}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"},
        {"role": "user", "content": "Thanks."},
    ]
    chat = to_chat(body)
    assert chat == {
        # every field the converter does not touch is copied (id_slot would be too)
        "model": "gpt-5-codex",
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "0199a7c3-session",
        "client_metadata": {"turn_id": "t-1", "sent_at": "2026-01-01T10:00:00Z"},
        "messages": [
            {"role": "system", "content": "You are Codex, a coding agent."},
            # `type` and `status` erased, parts become chat text parts
            {
                "role": "developer",
                "content": [{"text": "<permissions>workspace</permissions>", "type": "text"}],
            },
            {
                "role": "user",
                "content": [
                    {"text": "<environment_context>cwd=/w</environment_context>", "type": "text"},
                    {"text": "List the files.", "type": "text"},
                ],
            },
            # reasoning opens an assistant message; the message and the call merge into it
            {
                "role": "assistant",
                "content": [{"text": "Listing.", "type": "text"}],
                "reasoning_content": "Look first.",
                "tool_calls": [
                    {
                        "function": {"arguments": '{"command":["ls"]}', "name": "shell"},
                        "id": "call_1",
                        "type": "function",
                    }
                ],
            },
            {"content": "a.txt\nb.txt", "role": "tool", "tool_call_id": "call_1"},
            # string content becomes one input_text part first
            {"role": "user", "content": [{"text": "Thanks.", "type": "text"}]},
        ],
        # function tools nest under `function`, `strict` defaults to true; web_search is dropped
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "shell",
                    "description": "Runs a shell command and returns its output.",
                    "strict": False,
                    "parameters": SHELL_PARAMS,
                },
            },
            {
                "type": "function",
                "function": {
                    "name": "update_plan",
                    "description": "Updates the task plan.",
                    "parameters": PLAN["parameters"],
                    "strict": True,
                },
            },
        ],
        "max_tokens": 64,
        "reasoning_effort": "low",
    }
    assert "input" in body and body["tools"] == TOOLS  # the client's body is left alone


def test_items_the_server_keeps_apart_or_merges() -> None:
    chat = to_chat(
        {
            "input": [
                {"role": "user", "content": "Hi"},
                # an assistant message not after an assistant keeps its other fields
                {"type": "message", "role": "assistant", "id": "msg_1", "content": "Hello"},
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "refusal", "refusal": "No."}],
                },
                {"role": "user", "content": "Run it"},
                # a call after a user message is an assistant message of its own, no content
                {"type": "function_call", "call_id": "c2", "name": "shell", "arguments": "{}"},
                {"type": "function_call", "call_id": "c3", "name": "shell", "arguments": "[]"},
                {
                    "type": "function_call_output",
                    "call_id": "c2",
                    "output": [{"type": "input_text", "text": "ok"}],
                },
                {"type": "reasoning", "summary": [], "content": [{"text": "hm"}]},
            ]
        }
    )
    assert "tools" not in chat
    assert chat["messages"] == [
        {"role": "user", "content": [{"text": "Hi", "type": "text"}]},
        {
            "id": "msg_1",
            "role": "assistant",
            "content": [{"text": "Hello", "type": "text"}, {"refusal": "No.", "type": "refusal"}],
        },
        {"role": "user", "content": [{"text": "Run it", "type": "text"}]},
        {
            "role": "assistant",
            "tool_calls": [
                {"function": {"arguments": "{}", "name": "shell"}, "id": "c2", "type": "function"},
                {"function": {"arguments": "[]", "name": "shell"}, "id": "c3", "type": "function"},
            ],
        },
        {"content": [{"type": "text", "text": "ok"}], "role": "tool", "tool_call_id": "c2"},
        {"role": "assistant", "content": [], "reasoning_content": "hm"},
    ]


def test_string_input_and_instructions() -> None:
    assert to_chat({"input": "Hi"})["messages"] == [{"role": "user", "content": "Hi"}]
    # json_value(…, std::string()): null or another type is an empty system message
    assert to_chat({"input": "Hi", "instructions": None})["messages"][0] == {
        "role": "system",
        "content": "",
    }
    only_skipped = to_chat({"input": "Hi", "tools": [{"type": "web_search"}]})
    assert "tools" not in only_skipped
    assert "previous_response_id" in to_chat({"input": "Hi", "previous_response_id": ""})


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({}, "'input' is required"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": 3}, "'input' must be a string or array of objects"),
        ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input_file"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "requires 'text'"),
        # an assistant item without type "message" is not one the server knows
        ({"input": [{"role": "assistant", "content": "Hi"}]}, "Cannot determine type"),
        ({"input": [{"type": "custom_tool_call", "call_id": "c", "input": "x"}]}, "Cannot"),
        # reasoning without its text, as a client that drops reasoning text sends it
        ({"input": [{"type": "reasoning", "summary": []}]}, "is not an array"),
        ({"input": [{"type": "reasoning", "summary": [], "content": []}]}, "is empty"),
        ({"input": "x", "tools": {"type": "function"}}, "'tools' must be an array"),
    ],
)
def test_bodies_the_server_rejects(body: dict[str, Any], message: str) -> None:
    with pytest.raises(NotConvertible, match=message):
        to_chat(body)
    read = ADAPTER.read(body, MODEL, None)
    assert isinstance(read, NotKeyed) and message in read.reason


def test_n_above_one_is_not_keyed() -> None:
    assert isinstance(ADAPTER.read(codex_body(n=2), MODEL, None), NotKeyed)
    assert isinstance(ADAPTER.read({"input": []}, MODEL, None), NotKeyed)


# --- keys


def conv_of(body: dict[str, Any], tenant: str | None = None) -> Conversation:
    conv = ADAPTER.read(body, MODEL, tenant)
    assert isinstance(conv, Conversation), conv
    return conv


def test_what_codex_changes_every_turn_does_not_change_the_keys() -> None:
    base = conv_of(codex_body())
    for changed in (
        codex_body(client_metadata={"turn_id": "t-2", "sent_at": "2026-01-01T10:05:00Z"}),
        codex_body(prompt_cache_key="another-session"),
        codex_body(metadata={"x": "y"}, user="someone", store=True, stream=False),
        codex_body(include=[]),
    ):
        other = conv_of(changed)
        assert (other.namespace, other.keys) == (base.namespace, base.keys)
    assert base.payload["client_metadata"]["turn_id"] == "t-1"  # forwarded as sent
    # the conversation is keyed as chat messages: instructions first, then the input items
    assert len(base.keys) == 3 and base.messages[0]["role"] == "system"
    assert base.template["tools"][0]["function"]["name"] == "shell"
    assert base.template["reasoning_effort"] == "low"


def test_what_shapes_the_prompt_changes_the_keys() -> None:
    base = conv_of(codex_body())
    instructions = conv_of(codex_body(instructions="You are someone else."))
    assert instructions.namespace == base.namespace
    assert instructions.keys[0] != base.keys[0]
    tools = conv_of(codex_body(tools=[SHELL]))
    effort = conv_of(codex_body(reasoning={"effort": "high"}))
    tenant = conv_of(codex_body(), tenant="t2")
    assert len({base.namespace, tools.namespace, effort.namespace, tenant.namespace}) == 4
    # a non-function tool is dropped by the server: it shapes nothing
    assert conv_of(codex_body(tools=[SHELL, PLAN])).namespace == base.namespace


def test_the_same_prompt_keys_alike_through_chat() -> None:
    """The namespace and keys are those of the chat body the server renders."""
    from kvproxy.wire.chat import ChatAdapter

    body = codex_body()
    chat = ChatAdapter().read(to_chat(body), MODEL, None)
    assert isinstance(chat, Conversation)
    assert chat.keys == conv_of(body).keys


def server_response(output: list[dict[str, Any]], cached: int, total: int) -> dict[str, Any]:
    """A non-streamed reply as to_json_oaicompat_resp writes it (no timings)."""
    return {
        "completed_at": 1,
        "created_at": 1,
        "id": "resp_x",
        "model": "m",
        "object": "response",
        "output": output,
        "status": "completed",
        "usage": {
            "input_tokens": total,
            "output_tokens": 9,
            "total_tokens": total + 9,
            "input_tokens_details": {"cached_tokens": cached},
        },
    }


MESSAGE_OUT = {
    "content": [{"type": "output_text", "annotations": [], "logprobs": [], "text": "Two files. "}],
    "id": "msg_abc",
    "role": "assistant",
    "status": "completed",
    "type": "message",
}
CALL_OUT = {
    "id": "fc_k9",
    "type": "function_call",
    "status": "completed",
    "arguments": '{"command":["cat","a.txt"]}',
    "call_id": "call_k9",
    "name": "shell",
}


def as_client_echoes(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What a Codex-like client puts back into `input`: the output items, minus annotations."""
    items = []
    for item in output:
        if item["type"] == "message":
            items.append(
                {
                    "type": "message",
                    "role": "assistant",
                    "id": item["id"],
                    "content": [
                        {"type": "output_text", "text": p["text"]} for p in item["content"]
                    ],
                }
            )
        elif item["type"] == "function_call":
            keep = ("type", "id", "call_id", "name", "arguments")
            items.append({k: item[k] for k in keep})
    return items


def capture(payload: bytes, streaming: bool) -> Reply | None:
    cap = ResponsesCapture(streaming)
    for i in range(0, len(payload), 7):  # in pieces, as relayed
        cap.feed(payload[i : i + 7])
    return cap.finish()


def test_json_reply_is_captured_with_timings_from_usage() -> None:
    body = server_response([MESSAGE_OUT, CALL_OUT], cached=1200, total=1234)
    reply = capture(orjson.dumps(body), streaming=False)
    assert reply is not None and reply.complete
    assert reply.content == "Two files. "
    assert reply.finish_reason == "tool_calls"
    assert reply.tool_calls == [
        {
            "id": "call_k9",
            "type": "function",
            "function": {"name": "shell", "arguments": '{"command":["cat","a.txt"]}'},
        }
    ]
    assert reply.timings == {"cache_n": 1200, "prompt_n": 34, "predicted_n": 9}


def sse(events: list[dict[str, Any]]) -> bytes:
    """format_oai_resp_sse: `event:` and `data:` lines, no [DONE]."""
    return b"".join(
        b"event: " + e["type"].encode() + b"\ndata: " + orjson.dumps(e) + b"\n\n" for e in events
    )


def test_streamed_reply_is_read_from_the_completed_event_with_its_timings() -> None:
    timings = {"cache_n": 1201, "prompt_n": 33, "prompt_ms": 80.0, "predicted_n": 9}
    completed = server_response([MESSAGE_OUT], cached=1201, total=1234)
    del completed["completed_at"], completed["object"]
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": {"id": "resp_x", "status": "in_progress"}},
        {"type": "response.output_text.delta", "item_id": "msg_abc", "delta": "Two"},
        {"type": "response.output_text.delta", "item_id": "msg_abc", "delta": " files. "},
        {"type": "response.output_item.done", "item": MESSAGE_OUT},
        {"type": "response.completed", "response": completed, "timings": timings},
    ]
    reply = capture(sse(events), streaming=True)
    assert reply is not None and reply.complete and reply.finish_reason == "stop"
    assert reply.content == "Two files. " and reply.tool_calls == []
    assert reply.timings == timings
    # broken off before the final event: nothing is known about what the slot holds
    assert capture(sse(events[:-1]), streaming=True) is None
    assert capture(b'data: {"error": {"code": 500}}\n\n', streaming=True) is None


def test_unfinished_responses_are_not_complete() -> None:
    failed = {**server_response([MESSAGE_OUT], 0, 10), "status": "failed"}
    assert not parse_response(failed, None).complete
    cut = {
        **server_response([MESSAGE_OUT], 0, 10),
        "status": "incomplete",
        "incomplete_details": {"reason": "max_output_tokens"},
    }
    assert parse_response(cut, None).finish_reason == "length"


@pytest.mark.parametrize("output", [[MESSAGE_OUT], [CALL_OUT], [MESSAGE_OUT, CALL_OUT]])
def test_next_turn_keys_extend_this_turns_keys_by_the_echoed_reply(
    output: list[dict[str, Any]],
) -> None:
    """the driver records (Slot.replied) keys + extend(keys[-1], echoed): the client's next
    turn, built from the output items, must start with exactly that chain."""
    turn1 = codex_body()
    conv1 = conv_of(turn1)
    reply = parse_response(server_response(output, 0, 100), None)
    echoed = ADAPTER.echoed(reply)
    recorded = [*conv1.keys, keys.extend(conv1.keys[-1], echoed)]

    turn2 = codex_body(client_metadata={"turn_id": "t-2"})
    turn2["input"] = [*turn1["input"], *as_client_echoes(output)]
    if any(item["type"] == "function_call" for item in output):
        turn2["input"].append(
            {"type": "function_call_output", "call_id": "call_k9", "output": "hello"}
        )
    turn2["input"].append(
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Next?"}]}
    )
    conv2 = conv_of(turn2)
    assert conv2.keys[: len(recorded)] == recorded
    assert len(conv2.keys) > len(recorded)
    # the recorded messages are the ones the canonical prefix renders: the server's form
    echoed_in_turn2 = conv2.messages[len(conv1.messages)]
    assert keys.message_bytes(echoed_in_turn2) == keys.message_bytes(echoed)


def test_reasoning_is_echoed_only_with_keep_reasoning() -> None:
    reply = Reply(content="Done.", reasoning="Because.", finish_reason="stop")
    assert "reasoning_content" not in ADAPTER.echoed(reply)
    kept = ResponsesAdapter(keep_reasoning=True).echoed(reply)
    assert kept == {
        "role": "assistant",
        "content": [{"text": "Done.", "type": "text"}],
        "reasoning_content": "Because.",
    }


def test_pinned_body_is_the_clients_plus_id_slot() -> None:
    body = codex_body()
    assert orjson.loads(ADAPTER.pinned(body, 1)) == {**body, "id_slot": 1}
    assert ADAPTER.upstream_path("/v1/responses?x=1") == "/v1/responses?x=1"


async def test_responses_routes_are_keyed(proxy: RunningProxy) -> None:
    service = proxy.app[SERVICE]
    for path in ("/v1/responses", "/responses"):
        decision = service.routes.decide("POST", path)
        assert decision.treatment is Treatment.KEYED
        assert isinstance(service.adapters[decision.api], ResponsesAdapter)


# --- against a real llama-server

HANDFUL = 8
MAX_OUTPUT = 12
RESULTS: list[dict[str, Any]] = []


class CodexSession:
    """One Codex-like session: long instructions, input items that only grow (with their ids),
    the same tools and session id every turn, client_metadata new every turn."""

    def __init__(self, n: int, stream: bool) -> None:
        self.n = n
        self.stream = stream
        self.session_id = str(uuid.uuid4())
        self.instructions = system_prompt(n, n_facts=65)  # ~1,400 tokens
        self.items: list[dict[str, Any]] = [
            {
                **user_item(f"<permissions>project{n} is writable</permissions>"),
                "role": "developer",
            },
            user_item(f"<environment_context>cwd=/work/project{n}</environment_context>"),
            user_item("Which files are here?"),
            {
                "type": "function_call",
                "id": f"fc_{n}",
                "call_id": f"call_{n}",
                "name": "shell",
                "arguments": '{"command":["ls"]}',
            },
            {"type": "function_call_output", "call_id": f"call_{n}", "output": "README.md\nsrc"},
            {
                "type": "message",
                "role": "assistant",
                "id": f"msg_{n}",
                "content": [{"type": "output_text", "text": "README.md and src."}],
            },
        ]
        self.turn = 0

    def body(self) -> dict[str, Any]:
        self.turn += 1
        self.items.append(user_item(f"What does fact {self.turn + 2} of project {self.n} say?"))
        return {
            "model": "gemma",
            "instructions": self.instructions,
            "input": copy.deepcopy(self.items),
            "tools": TOOLS,
            "tool_choice": "auto",
            "parallel_tool_calls": False,
            "store": False,
            "stream": self.stream,
            "include": [],
            "prompt_cache_key": self.session_id,
            "client_metadata": {"turn_id": str(uuid.uuid4()), "sent_at": time.time()},
            "max_output_tokens": MAX_OUTPUT,
            "temperature": 0,
        }

    def took(self, response: dict[str, Any]) -> None:
        # Gemma's template renders no tools, so the server parses no calls: each turn ends
        # with the reply and the next one starts with the user's message (see new_tokens).
        assert all(item["type"] == "message" for item in response["output"]), response
        self.items += as_client_echoes(response["output"])


def user_item(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}


async def respond(base: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The response object (from `response.completed` when streamed) and the headers."""
    async with aiohttp.ClientSession() as s, s.post(base + "/v1/responses", json=body) as r:
        assert r.status == 200, await r.text()
        headers = dict(r.headers)
        if not body.get("stream"):
            return await r.json(), headers
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    for line in raw.split(b"\n"):
        if line.startswith(b"data: "):
            event = orjson.loads(line[6:])
            if event.get("type") == "response.completed":
                response: dict[str, Any] = event["response"]
                assert event["timings"]["cache_n"] == cached(response)
                return response, headers
    raise AssertionError(f"no response.completed event in {raw[-300:]!r}")


def cached(response: dict[str, Any]) -> int:
    return int(response["usage"]["input_tokens_details"]["cached_tokens"])


def prefilled(response: dict[str, Any]) -> int:
    return int(response["usage"]["input_tokens"]) - cached(response)


async def input_tokens(server: str, body: dict[str, Any]) -> int:
    """The server's own count of the prompt it renders for a Responses body."""
    async with (
        aiohttp.ClientSession() as s,
        s.post(server + "/v1/responses/input_tokens", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return int((await r.json())["input_tokens"])


async def new_tokens(server: str, body: dict[str, Any]) -> int:
    """Tokens of this turn's prompt beyond the conversation as the client echoed it: the new
    user message and the generation prompt (counted by the server, not by kvproxy)."""
    before = {**body, "input": body["input"][:-1], "add_generation_prompt": False}
    return await input_tokens(server, body) - await input_tokens(server, before)


async def turn(
    base: str, server: str, session: CodexSession, case: str
) -> tuple[dict[str, Any], dict[str, str], int]:
    body = session.body()
    response, headers = await respond(base, body)
    session.took(response)
    new = await new_tokens(server, body) if session.turn > 1 else 0
    RESULTS.append(
        {
            "case": case,
            "stream": session.stream,
            "conv": session.n,
            "turn": session.turn,
            "decision": headers.get("X-KVProxy-Cache", "-"),
            "prompt": response["usage"]["input_tokens"],
            "cached": cached(response),
            "prefilled": prefilled(response),
            "new": new,
        }
    )
    return response, headers, new


@pytest.fixture(scope="module", autouse=True)
def print_table() -> Iterator[None]:
    yield
    if not RESULTS:
        return
    print("\n| case | stream | conv | turn | X-KVProxy-Cache | prompt | cached | prefilled | new |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in RESULTS:
        print(
            f"| {r['case']} | {r['stream']} | {r['conv']} | {r['turn']} | {r['decision']} | "
            f"{r['prompt']} | {r['cached']} | {r['prefilled']} | {r['new']} |"
        )


@pytest.fixture
def own_cache() -> Iterator[tuple[Path, list[RealServer]]]:
    """A private cache dir, and the servers a test starts on it (stopped at the end)."""
    with tempfile.TemporaryDirectory(prefix="kvproxy-responses-") as tmp:
        cache = Path(tmp) / "cache"
        cache.mkdir(mode=0o700)
        servers: list[RealServer] = []
        try:
            yield cache, servers
        finally:
            for server in servers:
                server.stop()


@pytest.mark.real
async def test_the_conversion_renders_the_prompt_the_server_renders(
    own_cache: tuple[Path, list[RealServer]],
) -> None:
    """The Responses body, then its mirror sent as chat to the same slot: the server finds the
    whole prompt in the slot (cache_n = prompt - 1, the one token it always re-evaluates)."""
    cache, servers = own_cache
    servers.append(start_real_server(cache))
    url = servers[0].url
    body = CodexSession(7, stream=False).body()
    body["input"].append({"role": "user", "content": "And the files?"})
    response, _ = await respond(url, {**body, "id_slot": 0, "max_output_tokens": 1})
    chat = {**to_chat(body), "id_slot": 0, "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=chat) as r,
    ):
        assert r.status == 200, await r.text()
        timings = (await r.json())["timings"]
    n = response["usage"]["input_tokens"]
    assert n > 1300
    assert (timings["cache_n"], timings["prompt_n"]) == (n - 1, 1)


@pytest.mark.real
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_codex_conversation_comes_back_from_disk_after_evictions(
    stream: bool,
    own_cache: tuple[Path, list[RealServer]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Three sessions through two slots, in turn order 1,2,3: each turn evicts the session
    that comes next, so every later turn of every session is restored from disk."""
    caplog.set_level(logging.INFO, logger="kvproxy.request")
    cache, servers = own_cache
    servers.append(start_real_server(cache))
    server = servers[0].url
    proxy = await start_proxy(server, cache, min_tokens=256)
    try:
        sessions = [CodexSession(n, stream) for n in (1, 2, 3)]
        for round_ in (1, 2, 3):
            for session in sessions:
                response, headers, new = await turn(proxy.url, server, session, "eviction")
                if round_ == 1:
                    assert headers["X-KVProxy-Cache"] == "miss"
                    continue
                assert headers["X-KVProxy-Cache"] == "restored", headers
                assert int(headers["X-KVProxy-Restored-Tokens"]) > 1300
                assert prefilled(response) <= new + HANDFUL, (response["usage"], new)
        stats = proxy.stats()
        assert stats["restores"] == 6 and stats["restore_failures"] == 0
        assert stats["requests"]["restored"] == 6
        lines = [r.getMessage() for r in caplog.records if r.name == "kvproxy.request"]
        restored = [line for line in lines if line.startswith("/v1/responses ")]
        assert len(restored) == 9
        assert sum(" restored " in line and "cache_n=" in line for line in restored) == 6
        assert all("prompt_n=" in line for line in restored)
    finally:
        await proxy.stop()


@pytest.mark.real
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_codex_conversation_survives_a_restart_of_proxy_and_server(
    stream: bool, own_cache: tuple[Path, list[RealServer]]
) -> None:
    cache, servers = own_cache
    servers.append(start_real_server(cache))
    proxy = await start_proxy(servers[0].url, cache, min_tokens=256)
    session = CodexSession(4, stream)
    _, headers, _ = await turn(proxy.url, servers[0].url, session, "restart")
    assert headers["X-KVProxy-Cache"] == "miss"
    await proxy.stop()  # graceful: the resident conversation is saved
    servers[0].stop()
    assert len(committed(cache)) == 1

    servers.append(start_real_server(cache))
    server = servers[1].url
    proxy = await start_proxy(server, cache, min_tokens=256)
    try:
        for expected in ("restored", "resident"):
            response, headers, new = await turn(proxy.url, server, session, "restart")
            assert headers["X-KVProxy-Cache"] == expected, headers
            assert prefilled(response) <= new + HANDFUL, (response["usage"], new)
    finally:
        await proxy.stop()


async def erase_slots(server: str) -> None:
    async with aiohttp.ClientSession() as s:
        for slot in (0, 1):
            async with s.post(f"{server}/slots/{slot}?action=erase") as r:
                assert r.status == 200, await r.text()


@pytest.mark.real
async def test_never_worse_than_the_server_alone(own_cache: tuple[Path, list[RealServer]]) -> None:
    """The same Codex-shaped session straight to llama-server (which picks the slot by
    content) and through kvproxy: kvproxy's later turns reuse at least as much."""
    cache, servers = own_cache
    servers.append(start_real_server(cache))
    server = servers[0].url
    direct = CodexSession(5, stream=True)
    seen_direct = [(await turn(server, server, direct, "direct"))[0] for _ in range(3)]

    await erase_slots(server)  # kvproxy starts from empty slots, as the server did
    proxy = await start_proxy(server, cache, min_tokens=256)
    try:
        through = CodexSession(5, stream=True)
        seen_proxy = []
        for i in range(3):
            response, headers, _ = await turn(proxy.url, server, through, "kvproxy")
            assert headers["X-KVProxy-Cache"] == ("miss" if i == 0 else "resident")
            seen_proxy.append(response)
    finally:
        await proxy.stop()
    for mine, theirs in zip(seen_proxy[1:], seen_direct[1:], strict=True):
        assert prefilled(mine) <= prefilled(theirs), (mine["usage"], theirs["usage"])
        if mine["usage"]["input_tokens"] == theirs["usage"]["input_tokens"]:
            assert cached(mine) >= cached(theirs)
