"""End to end with a real llama-server and the official OpenAI SDK: nothing changes but the hop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from .conftest import RealServer, RunningProxy, start_proxy

pytestmark = pytest.mark.real

MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Name three colours of the rainbow."},
]


@pytest.fixture
async def rproxy(real_server: RealServer, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    running = await start_proxy(real_server.url, real_server.cache_dir)
    yield running
    await running.stop()


async def chat(
    base: str, stream: bool, messages: list[ChatCompletionMessageParam] = MESSAGES
) -> str:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    async with client:
        if not stream:
            done = await client.chat.completions.create(
                model="any", messages=messages, temperature=0, max_tokens=24, seed=1
            )
            return done.choices[0].message.content or ""
        out = []
        events = await client.chat.completions.create(
            model="any", messages=messages, temperature=0, max_tokens=24, seed=1, stream=True
        )
        async for event in events:
            if event.choices and event.choices[0].delta.content:
                out.append(event.choices[0].delta.content)
        return "".join(out)


@pytest.mark.parametrize("stream", [False, True])
async def test_sdk_answers_match_the_direct_server(
    real_server: RealServer, rproxy: RunningProxy, stream: bool
) -> None:
    via_proxy = await chat(rproxy.url, stream)
    direct = await chat(real_server.url, stream)
    assert via_proxy and via_proxy == direct


async def test_read_only_routes_pass_through(real_server: RealServer, rproxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as s:
        for method, path, body in (
            ("GET", "/health", None),
            ("GET", "/props", None),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"content": "hello world"}),
            ("POST", "/apply-template", {"messages": MESSAGES}),
        ):
            async with (
                s.request(method, rproxy.url + path, json=body) as a,
                s.request(method, real_server.url + path, json=body) as b,
            ):
                assert a.status == b.status == 200, path
                ja, jb = await a.json(), await b.json()
                if path == "/props":
                    ja.pop("is_sleeping", None), jb.pop("is_sleeping", None)
                if path == "/v1/models":
                    for m in ja["data"] + jb["data"]:
                        m.pop("created", None)
                assert ja == jb, path


async def test_slot_erase_is_refused(real_server: RealServer, rproxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as s, s.post(rproxy.url + "/slots/0?action=erase") as resp:
        assert resp.status == 403
