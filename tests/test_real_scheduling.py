"""When saves run on the real llama-server, whose slot save pauses every other slot's token
stream: a background save started while another slot streams waits until the stream ends;
SIGTERM saves what fits in its deadline and names the rest (the 8B-geometry model at small
sizes: 128 KiB a token, so a few hundred tokens make a save longer than a generated token).
A reply ending in a tool call keeps its slot against a newcomer, and one that had to leave it
is restored into the next slot that frees before its result comes (Gemma 3 270M, which calls
tools: kvproxy_bench.toolcalls)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from kvproxy_bench.dialogues import first_turn
from kvproxy_bench.toolcalls import TOOL_REQUEST, agent, with_result, write_template

from kvproxy.server.managed import free_port
from kvproxy.store import Store

from .conftest import RealServer, bundled_model, module_server, start_proxy, start_real_server
from .ggufmodels import KV_BYTES_PER_TOKEN_F16, big_model_file
from .test_managed import wait_ready

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def big_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    extra = ("--cache-ram", "0")
    with module_server(
        tmp_path_factory, "scheduling-big", big_model_file, slots=2, ctx_per_slot=2048, extra=extra
    ) as server:
        yield server


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    """Gemma 3 270M with a chat template that calls tools, 2 slots."""
    root = tmp_path_factory.mktemp("scheduling-tools")
    cache = root / "cache"
    cache.mkdir(mode=0o700)
    template = write_template(root)
    extra = ("--cache-ram", "0", "--swa-full", "--chat-template-file", str(template))
    server = start_real_server(cache, bundled_model(), slots=2, ctx_per_slot=4096, extra=extra)
    try:
        yield server
    finally:
        server.stop()


def emptied(server: RealServer) -> Path:
    for path in server.cache_dir.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    return server.cache_dir


async def post(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/v1/chat/completions", json=body) as r,
    ):
        assert r.status == 200, await r.text()
        return dict(await r.json()), dict(r.headers)


async def test_a_background_save_waits_until_another_slots_stream_ends(
    big_server: RealServer,
) -> None:
    """Conversation A (~850 tokens: 110 MB, longer to write than a token takes to generate)
    is idle on one slot; a stream starts on the other; A's idle save comes due during the
    stream (--idle-save-after 2) and is written only once the stream has ended."""
    proxy = await start_proxy(
        big_server.url, emptied(big_server), idle_save_after=2.0, live_window=0
    )
    try:
        await post(proxy.url, {"messages": first_turn(1, n_facts=15), "max_tokens": 4})
        a = next(s for s in proxy.cache.pool.slots if s.holding is not None)
        assert a.holding is not None and a.holding.n_tokens >= 800 and not a.saved
        assert (proxy.cache.lane.gate.save_seconds(a) or 0) > (
            proxy.cache.lane.pace.token_gap_s or 0
        ), "A's save is not longer than a token: the test would show nothing"
        # Longer than any machine streams in the 4 s read below: the client leaves then.
        body = {
            "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
        }
        seen: list[tuple[float, bool]] = []  # at each token: how long A was idle, saved
        async with (
            aiohttp.ClientSession() as s,
            s.post(proxy.url + "/v1/chat/completions", json=body) as r,
        ):
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: {"):
                    event = orjson.loads(line[6:])
                    if event.get("choices"):
                        seen.append((time.monotonic() - a.last_used, a.saved))
                if seen and seen[-1][0] > 4.0:
                    break  # well past A's save coming due: the stream ends here
        due = [saved for idle, saved in seen if idle > 2.5]
        assert due, f"the stream ended before A's save came due: {seen}"
        assert not any(saved for _, saved in seen), "A was saved while the stream ran"
        for _ in range(600):  # the save, once the stream ended (counted once committed)
            if a.saved and proxy.stats()["background_saves"] == 1:
                break
            await asyncio.sleep(0.1)
        assert a.saved and proxy.stats()["background_saves"] == 1
    finally:
        await proxy.stop()


def sigterm_slots(cache: Path, log: Path, port: int, model: Path) -> subprocess.Popen[str]:
    with open(log, "a") as out:
        return subprocess.Popen(
            [
                *(sys.executable, "-m", "kvproxy.cli", "serve", "--model", str(model)),
                *("--port", str(port), "--cache-dir", str(cache), "--slots", "3"),
                *("--ctx-size", str(3 * 2048), "--min-tokens", "0"),
                *("--idle-save-after", "3600", "--live-window", "0"),
                # 2 s: 1.5 s of it for the saves, once the requests in flight are done.
                *("--shutdown-timeout", "2"),
                *("--", "--cache-ram", "0"),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


@pytest.mark.timeout(900)
async def test_sigterm_saves_what_fits_the_most_recent_first_and_names_the_rest(
    tmp_path: Path,
) -> None:
    """Three slots, nothing saved before SIGTERM, 1.5 s to save: at the assumed 150 MB/s (no
    save measured yet) and the model's 128 KiB a token, the two recent ~300-token states
    (~40 MB each) fit, the older ~1,400-token one (~180 MB, ~1.2 s) does not after them. It
    is named in the log as not saved, with its key; the others are on disk, committed."""
    cache, log, port = tmp_path / "cache", tmp_path / "kvproxy.log", free_port()
    proc = sigterm_slots(cache, log, port, big_model_file(tmp_path))
    url = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(wait_ready, proc, log, port)
        tokens = {}
        for n, facts in ((1, 25), (2, 4), (3, 4)):  # the big one first: the least recent
            body, _ = await post(url, {"messages": first_turn(n, n_facts=facts), "max_tokens": 2})
            tokens[n] = body["timings"]["cache_n"] + body["timings"]["prompt_n"]
        seconds = {n: t * KV_BYTES_PER_TOKEN_F16 / 150e6 for n, t in tokens.items()}
        assert seconds[2] + seconds[3] < 1.0 and sum(seconds.values()) > 1.5, seconds
        async with aiohttp.ClientSession() as s, s.get(url + "/kvproxy/stats") as r:
            slots = (await r.json())["slots"]
        keys = {s["n_tokens"]: s["key"] for s in slots if s["key"]}
        assert len(keys) == 3 and not any(s["saved"] for s in slots if s["key"])
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(proc.wait, 60) in (0, 1)
        text = log.read_text()
        print(text[-2500:])
        store = Store(cache, 86400.0, 1 << 40)
        store.open_readonly()
        try:
            saved = {e.key for e in store.entries.values()}
        finally:
            store.close()
        lost_line = next((ln for ln in text.splitlines() if "not saved" in ln), "")
        named = {key for key in keys.values() if key[:12] in lost_line}
        big = max(keys)
        assert keys[big] in named and keys[big] not in saved, text[-3000:]
        # Every slot is either on disk or named as lost, never both.
        assert named | saved >= set(keys.values()) and not named & saved, text[-3000:]
        assert saved, "nothing fitted: the test would show nothing"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def tool_call(url: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body, _ = await post(url, {"messages": messages, **TOOL_REQUEST, "max_tokens": 48})
    assert body["choices"][0]["finish_reason"] == "tool_calls", body
    return body


async def result_turn(
    url: str, messages: list[dict[str, Any]], reply: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The tool's result comes back (its reply may call the tool again)."""
    body = {"messages": with_result(messages, reply), **TOOL_REQUEST, "max_tokens": 48}
    return await post(url, body)


def talk(n: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"Say hello to person {n}. " + "Thanks. " * 40}]


async def tool_loop_against_a_newcomer(
    server: RealServer, **settings: Any
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """Agent 1 gets a tool call back; conversation 2 talks after it (so 1's slot is the least
    recently used); newcomer 3 needs a slot; then 1's tool result comes. (The tool call's
    reply, the result's reply and its headers.)"""
    proxy = await start_proxy(server.url, emptied(server), live_window=0, **settings)
    try:
        one = await tool_call(proxy.url, agent(1))
        await post(proxy.url, {"messages": talk(2), "max_tokens": 4})
        await post(proxy.url, {"messages": talk(3), "max_tokens": 4})
        body, headers = await result_turn(proxy.url, agent(1), one)
        return one, body, headers
    finally:
        await proxy.stop()


async def test_a_tool_loop_keeps_its_slot_against_a_newcomer(tool_server: RealServer) -> None:
    one, body, headers = await tool_loop_against_a_newcomer(tool_server)
    assert headers["X-KVProxy-Cache"] == "resident"
    held = one["timings"]["cache_n"] + one["timings"]["prompt_n"]
    assert body["timings"]["cache_n"] >= held


async def test_without_the_rule_a_newcomer_takes_the_tool_loops_slot(
    tool_server: RealServer,
) -> None:
    _, _, headers = await tool_loop_against_a_newcomer(tool_server, tool_result_within=0)
    assert headers["X-KVProxy-Cache"] == "restored"


async def test_a_tool_loop_that_lost_its_slot_is_restored_before_its_result_comes(
    tool_server: RealServer,
) -> None:
    """Both slots wait for tool results when a newcomer comes: it takes agent 1's (saved
    first). Once the newcomer's reply is done, 1's state is restored into that slot (what the
    newcomer left saved first), and 1's result finds it resident."""
    proxy = await start_proxy(tool_server.url, emptied(tool_server), live_window=0)
    try:
        one = await tool_call(proxy.url, agent(1))
        two = await tool_call(proxy.url, agent(2))
        await post(proxy.url, {"messages": talk(3), "max_tokens": 4})
        for _ in range(600):
            if proxy.stats()["prefetches"] == 1:
                break
            await asyncio.sleep(0.1)
        assert proxy.stats()["prefetches"] == 1
        body, headers = await result_turn(proxy.url, agent(1), one)
        assert headers["X-KVProxy-Cache"] == "resident"
        assert body["timings"]["cache_n"] >= one["timings"]["prompt_n"]
        body, headers = await result_turn(proxy.url, agent(2), two)
        assert headers["X-KVProxy-Cache"] == "resident"
        assert len(proxy.cache.store.entries) >= 2  # 1 (saved for the newcomer), 3 (for 1)
    finally:
        await proxy.stop()
