"""Restores that hit on every model class, against a real llama-server (-np 2, --cache-ram 0).

For dense (generated llama), SWA (Gemma 3 270M with --swa-full), recurrent (generated Mamba)
and hybrid (generated LFM2): a conversation's turn 2 comes back from disk after an eviction
and after a restart of both processes, and prefills only the new message plus a handful of
tokens, also when the client echoes the reply trimmed. The models' replies are forced with a
grammar so that the generated text ends in whitespace the client then trims.

`pytest tests/test_real_classes.py -s` prints the table the README shows.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvproxy_bench.dialogues import system_prompt

from .conftest import RealServer, bundled_model, start_proxy, start_real_server

pytestmark = pytest.mark.real

HANDFUL = 8
REPLY = "The answer is forty two.  \n"
GRAMMAR = 'root ::= "' + REPLY.replace("\n", "\\n") + '"'
CLASSES = ("dense", "swa", "recurrent", "hybrid")
RESULTS: list[dict[str, Any]] = []


def model_for(kind: str, tiny_models: dict[str, Path]) -> tuple[Path, tuple[str, ...]]:
    if kind == "swa":
        return bundled_model(), ("--cache-ram", "0", "--swa-full")
    return tiny_models[kind], ("--cache-ram", "0")


def first_messages(n: int) -> list[dict[str, Any]]:
    # ~700 tokens: past Gemma's 512-token sliding window, quick on every model here.
    return [
        {"role": "system", "content": system_prompt(n, n_facts=30)},
        {"role": "user", "content": f"What is fact {n}?"},
    ]


async def post(base: str, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body) as r:
        assert r.status == 200, await r.text()
        return await r.json(), dict(r.headers)


async def chat(base: str, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    body = {"messages": messages, "temperature": 0, "max_tokens": 64, "grammar": GRAMMAR}
    return await post(base, "/v1/chat/completions", body)


async def n_tokens(server: str, messages: list[dict[str, Any]], generation_prompt: bool) -> int:
    rendered, _ = await post(
        server,
        "/apply-template",
        {"messages": messages, "add_generation_prompt": generation_prompt},
    )
    tokens, _ = await post(
        server, "/tokenize", {"content": rendered["prompt"], "add_special": True}
    )
    return len(tokens["tokens"])


def trimmed_turn2(
    messages: list[dict[str, Any]], reply: dict[str, Any], n: int
) -> list[dict[str, Any]]:
    content = reply["choices"][0]["message"]["content"]
    assert content == REPLY  # the grammar made the model say it, whitespace included
    return [
        *messages,
        {"role": "assistant", "content": content.strip()},
        {"role": "user", "content": f"Thanks. And what comes after fact {n}?"},
    ]


async def new_message_tokens(server: str, turn2: list[dict[str, Any]]) -> int:
    """Tokens of turn 2's prompt beyond the conversation as the client echoed it."""
    return await n_tokens(server, turn2, True) - await n_tokens(server, turn2[:-1], False)


@pytest.fixture(scope="module", autouse=True)
def print_table() -> Iterator[None]:
    """The table for the README (`-s` shows it)."""
    yield
    print("\n| class | case | decision | turn-2 prompt | cache_n | prompt_n | new message |")
    print("|---|---|---|---|---|---|---|")
    for r in RESULTS:
        print(
            f"| {r['class']} | {r['case']} | {r['decision']} | {r['prompt']} | "
            f"{r['cache_n']} | {r['prompt_n']} | {r['new']} |"
        )


def record(kind: str, case: str, reply: dict[str, Any], headers: dict[str, str], new: int) -> None:
    t = reply["timings"]
    RESULTS.append(
        {
            "class": kind,
            "case": case,
            "decision": headers["X-KVProxy-Cache"],
            "prompt": t["cache_n"] + t["prompt_n"],
            "cache_n": t["cache_n"],
            "prompt_n": t["prompt_n"],
            "new": new,
        }
    )
    assert headers["X-KVProxy-Cache"] == "restored", headers
    assert t["prompt_n"] <= new + HANDFUL, (kind, case, t, new)


@pytest.mark.parametrize("kind", CLASSES)
async def test_turn2_after_eviction(
    kind: str, tiny_models: dict[str, Path], cache_dir: Path
) -> None:
    model, extra = model_for(kind, tiny_models)
    server = start_real_server(cache_dir, model, slots=2, ctx_per_slot=2048, extra=extra)
    proxy = await start_proxy(server.url, cache_dir)
    try:
        replies = {n: (await chat(proxy.url, first_messages(n)))[0] for n in (1, 2, 3)}
        turn2 = trimmed_turn2(first_messages(1), replies[1], 1)
        reply, headers = await chat(proxy.url, turn2)
        record(kind, "eviction", reply, headers, await new_message_tokens(server.url, turn2))
    finally:
        await proxy.stop()
        server.stop()


@pytest.mark.parametrize("kind", CLASSES)
async def test_turn2_after_restart(
    kind: str, tiny_models: dict[str, Path], cache_dir: Path
) -> None:
    model, extra = model_for(kind, tiny_models)
    servers: list[RealServer] = []
    try:
        servers.append(start_real_server(cache_dir, model, ctx_per_slot=2048, extra=extra))
        proxy = await start_proxy(servers[0].url, cache_dir)
        reply1, _ = await chat(proxy.url, first_messages(1))
        await proxy.stop()  # saves the slot, canonical prefix first
        servers[0].stop()
        servers.append(start_real_server(cache_dir, model, ctx_per_slot=2048, extra=extra))
        proxy = await start_proxy(servers[1].url, cache_dir)
        try:
            turn2 = trimmed_turn2(first_messages(1), reply1, 1)
            reply, headers = await chat(proxy.url, turn2)
            new = await new_message_tokens(servers[1].url, turn2)
            record(kind, "restart", reply, headers, new)
        finally:
            await proxy.stop()
    finally:
        for server in servers:
            server.stop()


async def test_swa_without_swa_full_stops_restoring(cache_dir: Path) -> None:
    """Gemma without --swa-full reuses nothing after a restore: after a few tries kvproxy
    stops restoring and saving for it, and requests go through as they would without it."""
    server = start_real_server(cache_dir, ctx_per_slot=2048, extra=("--cache-ram", "0"))
    proxy = await start_proxy(server.url, cache_dir)
    try:
        first = {n: (await chat(proxy.url, first_messages(n)))[0] for n in range(1, 6)}
        decisions, saves = [], []
        for n in range(1, 6):  # each comes back from disk: the slots hold the last two
            turn2 = trimmed_turn2(first_messages(n), first[n], n)
            reply, headers = await chat(proxy.url, turn2)
            decisions.append(headers["X-KVProxy-Cache"])
            saves.append(proxy.stats()["saves"])
            if headers["X-KVProxy-Cache"] == "miss":
                t = reply["timings"]
                assert t["cache_n"] == 0  # what the direct server does for this prompt
        assert decisions == ["restored"] * 3 + ["miss"] * 2
        assert proxy.stats()["ineffective_restores"] == 3
        assert proxy.stats()["model_class"] == "swa"
        assert proxy.stats()["restores"] == 3
        assert saves[3] == saves[4] == saves[2]  # nothing saved once restores stopped
    finally:
        await proxy.stop()
        server.stop()
