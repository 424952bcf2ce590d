"""The canonical prefix before a save, against the fake server's recurrent-model rule
(`reuse="extend"`: after a restore only a strict extension of the saved tokens is reused)."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any, TypeAlias

from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.habits.echo import observe_echo
from kvproxy.http.session import UpstreamError

from .conftest import Maker, start_proxy
from .fakeserver import FakeLlamaServer, render_chat
from .test_cache import chat, conv, settle

NEW = "and the next question?"


def ending_in_whitespace(messages: list[dict[str, Any]]) -> str:
    return "Here is my answer.  \n"


def new_turn_bound(text: str = NEW) -> int:
    """Tokens of the new message as rendered, plus the reply's closing marker (one or two
    tokens for a real tokenizer, 14 bytes here), plus a handful."""
    return len(render_chat([{"role": "user", "content": text}])) + len("<end_of_turn>\n") + 8


def trimmed_echo(reply: dict[str, Any]) -> dict[str, Any]:
    msg = reply["choices"][0]["message"]
    return {"role": "assistant", "content": msg["content"].strip()}


def completions_n_predict_0(fake: FakeLlamaServer) -> list[Any]:
    return [
        body
        for method, path, body in fake.requests
        if path == "/completion" and isinstance(body, dict) and body.get("n_predict") == 0
    ]


async def test_trimmed_echo_is_reused_after_eviction(make: Maker) -> None:
    fake, proxy = await make(server={"reuse": "extend", "reply": ending_in_whitespace})
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    turn2 = [*conv(1), trimmed_echo(replies[1]), {"role": "user", "content": NEW}]
    status, r, h = await chat(proxy, turn2)
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    assert r["timings"]["prompt_n"] <= new_turn_bound(), r["timings"]
    # Each saved slot was first made to hold its canonical prefix, given as tokens.
    evaluated = completions_n_predict_0(fake)
    saves = [a for a in fake.actions if a[0] == "save"]
    # Conversation 1 on 3's path; 2 and 3 in the background (3 live conversations, 2 slots),
    # so 1's return found its slot saved.
    assert len(evaluated) == len(saves) == 3
    assert all(isinstance(body["prompt"], list) for body in evaluated)


async def test_without_trimming_the_reply_is_reused_too(make: Maker) -> None:
    fake, proxy = await make(server={"reuse": "extend", "reply": ending_in_whitespace})
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    msg = replies[1]["choices"][0]["message"]
    turn2 = [
        *conv(1),
        {"role": "assistant", "content": msg["content"]},
        {"role": "user", "content": NEW},
    ]
    _, r, h = await chat(proxy, turn2)
    assert h["X-KVProxy-Cache"] == "restored"
    # The canonical prefix stops before the whitespace the echo styles disagree on.
    assert r["timings"]["prompt_n"] <= new_turn_bound() + len("  \n"), r["timings"]


async def test_re_serialised_tool_call_is_reused(make: Maker) -> None:
    # A tool loop would keep its slot against the newcomers; here it must leave to disk.
    fake, proxy = await make(server={"reuse": "extend"}, tool_result_within=0)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    first = [*conv(1)[:1], {"role": "user", "content": "please CALL_TOOL now"}]
    _, r1, _ = await chat(proxy, first, tools=tools)
    for c in (2, 3):
        await chat(proxy, conv(c), tools=tools)
    await settle(proxy)
    call = r1["choices"][0]["message"]["tool_calls"][0]
    compact = json.dumps(json.loads(call["function"]["arguments"]), separators=(",", ":"))
    echoed_call = {**call, "function": {**call["function"], "arguments": compact}}
    assert compact != call["function"]["arguments"]  # the client really re-serialised it
    turn2 = [
        *first,
        {"role": "assistant", "content": None, "tool_calls": [echoed_call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "42"},
    ]
    _, r, h = await chat(proxy, turn2, tools=tools)
    assert h["X-KVProxy-Cache"] == "restored"
    # Reused up to where the argument spellings differ: the whole earlier conversation.
    before_reply = len(render_chat(first, add_generation_prompt=False))
    assert r["timings"]["cache_n"] >= before_reply, r["timings"]


async def test_trimmed_echo_is_reused_after_restart(make: Maker) -> None:
    fake, proxy = await make(server={"reuse": "extend", "reply": ending_in_whitespace})
    _, r1, _ = await chat(proxy, conv(1))
    await settle(proxy)
    await proxy.stop()  # saves what the slots hold, canonical first
    await fake.stop()
    cache = fake.slot_save_path
    assert cache is not None
    fake2 = FakeLlamaServer(slot_save_path=cache, reuse="extend", reply=ending_in_whitespace)
    await fake2.start()
    proxy2 = await start_proxy(fake2.url, cache)
    try:
        turn2 = [*conv(1), trimmed_echo(r1), {"role": "user", "content": NEW}]
        _, r, h = await chat(proxy2, turn2)
        assert h["X-KVProxy-Cache"] == "restored"
        assert r["timings"]["prompt_n"] <= new_turn_bound(), r["timings"]
    finally:
        await proxy2.stop()
        await fake2.stop()


async def test_no_canonical_prefix_without_a_template(make: Maker) -> None:
    """A server that cannot render the probes: the slot is saved as it is, still restorable."""
    fake, proxy = await make()

    # A test double on this one session (patched for the proxy's life, which ends with the test).
    proxy.cache.backend.upstream.post_json = _failing_on(  # type: ignore[method-assign]
        "/apply-template", proxy.cache.backend.upstream.post_json
    )
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    assert completions_n_predict_0(fake) == []
    turn2 = [*conv(1), trimmed_echo(replies[1]), {"role": "user", "content": NEW}]
    _, r, h = await chat(proxy, turn2)
    assert h["X-KVProxy-Cache"] == "restored" and r["timings"]["cache_n"] > 300


# Upstream.post_json: (path, body, timeout) -> the parsed reply.
PostJson: TypeAlias = Callable[..., Coroutine[Any, Any, Any]]


def _failing_on(path: str, post_json: PostJson) -> PostJson:
    async def wrapped(p: str, body: Any, *args: Any) -> Any:
        if p == path:
            raise UpstreamError(f"{path}: 500", status=500)
        return await post_json(p, body, *args)

    return wrapped


def test_common_prefix() -> None:
    assert canonical.common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == [1, 2]
    assert canonical.common_prefix([[1], [2]]) == []
    assert canonical.common_prefix([[5, 6], [5, 6]]) == [5, 6]


def test_echo_variants_cover_trimming_and_argument_spacing() -> None:
    reply = {
        "role": "assistant",
        "content": " ok \n",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a":1}'}}
        ],
    }
    variants = canonical.echo_variants(reply)
    assert variants[0] == reply
    assert {v["content"] for v in variants} == {" ok \n", "ok"}
    args = {v["tool_calls"][0]["function"]["arguments"] for v in variants}
    assert args == {'{"a":1}', '{"a": 1}'}


def test_media_conversations_are_not_rendered() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert not canonical.renderable([{"role": "user", "content": [image]}])
    assert canonical.renderable([{"role": "user", "content": [{"type": "text", "text": "x"}]}])


def leading_newline(messages: list[dict[str, Any]]) -> str:
    return "\nA reply that starts on a new line, as some models write them."


async def test_a_verbatim_client_gets_the_whole_reply_once_seen(make: Maker) -> None:
    """Until kvproxy has seen how a client echoes replies, the prefix stops where the trimmed
    and untrimmed replies part (here at the reply's first character); once it has seen this
    client echo verbatim, the saved prefix takes in the whole reply."""
    fake, proxy = await make(server={"reuse": "extend", "reply": leading_newline})

    async def returning_turn(c: int) -> dict[str, Any]:
        first = conv(c)
        _, r1, _ = await chat(proxy, first)
        msg = r1["choices"][0]["message"]
        turn2 = [
            *first,
            {"role": "assistant", "content": msg["content"]},
            {"role": "user", "content": NEW},
        ]
        await chat(proxy, conv(c + 1))  # two more conversations push this one out to disk
        await chat(proxy, conv(c + 2))
        await settle(proxy)
        _, r, h = await chat(proxy, turn2)
        assert h["X-KVProxy-Cache"] == "restored"
        timings: dict[str, Any] = r["timings"]
        return timings

    before = await returning_turn(10)  # not seen yet: the whole reply is prefilled again
    assert before["prompt_n"] > new_turn_bound() + 40, before
    after = await returning_turn(20)  # seen verbatim (turn 2 of conversation 10 was resident)
    assert after["prompt_n"] <= new_turn_bound(), after
    assert proxy.cache.habits.echo._styles == {
        next(iter(proxy.cache.habits.echo._styles)): "verbatim"
    }


def test_observe_echo() -> None:
    ours = {"role": "assistant", "content": "\nHi there. "}
    assert observe_echo(ours, {"content": "\nHi there. "}) == "verbatim"
    assert observe_echo(ours, {"content": "Hi there."}) == "strip"
    assert observe_echo(ours, {"content": "\nHi there."}) == "rstrip"
    assert observe_echo(ours, {"content": "Something else"}) is None
    assert observe_echo({"content": "Hi"}, {"content": "Hi"}) is None  # tells nothing
