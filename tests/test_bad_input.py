"""Bad input: fuzzed and hand-written. The proxy answers with a clear OpenAI-style error or
forwards the request untouched; it never fails with its own 500 and never stops serving."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import orjson
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import Maker
from .test_cache import chat, conv

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=20,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", 3, None])},
    optional={"content": JSON, "tool_calls": JSON, "name": JSON, "tool_call_id": JSON},
)
BODY = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(MESSAGE, max_size=4), JSON)},
    optional={
        "n": JSON,
        "stream": st.booleans(),
        "id_slot": JSON,
        "tools": JSON,
        "max_tokens": st.just(4),
    },
)


async def post_raw(
    url: str, data: bytes, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url + "/v1/chat/completions",
            data=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        ) as r,
    ):
        return r.status, await r.read()


def assert_not_ours(status: int, raw: bytes) -> None:
    assert b"Traceback" not in raw
    if status >= 500:
        assert b"proxy_error" not in raw, raw[:300]


async def test_fuzzed_chat_bodies(make: Maker) -> None:
    fake, proxy = await make()
    seen: list[int] = []

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(BODY)
    def one(body: dict[str, Any]) -> None:
        status, raw = asyncio.run_coroutine_threadsafe(
            post_raw(proxy.url, orjson.dumps(body, option=orjson.OPT_NON_STR_KEYS)), loop
        ).result(30)
        assert_not_ours(status, raw)
        seen.append(status)

    loop = asyncio.get_running_loop()
    await asyncio.to_thread(one)
    assert len(seen) >= 100
    status, body, _ = await chat(proxy, conv(1))  # still serving
    assert status == 200 and body["choices"][0]["message"]["content"].startswith("Echo:")
    assert fake.deferred_actions == 0


async def test_hand_written_bad_bodies(make: Maker) -> None:
    fake, proxy = await make()
    cases = [
        (b"", 400),
        (b"{", 400),
        (b"\xff\xfe{}", 400),  # invalid UTF-8
        (b'{"messages": "hello"}', None),
        (b'{"messages": [{"role": "user", "content": {"a": 1}}]}', None),
        (b"[1, 2, 3]", None),
        (b'{"messages": [{"role": "user", "content": "hi"}], "id_slot": 99999999999}', 200),
        (b'{"messages": [{"role": "user", "content": "hi"}], "id_slot": -7}', 200),
        (b'{"messages": [{"role": "user", "content": "hi"}], "id_slot": "zero"}', 200),
    ]
    for data, expected in cases:
        status, raw = await post_raw(proxy.url, data)
        assert_not_ours(status, raw)
        if expected is not None:
            assert status == expected, (data, status, raw)
        if status == 400 and expected == 400:
            assert json.loads(raw)["error"]["type"] == "invalid_request_error"


async def test_unknown_fields_pass_through(make: Maker) -> None:
    fake, proxy = await make()
    await chat(proxy, conv(1), my_extension={"x": [1, 2]}, cache_prompt=True)
    body = next(b for _, p, b in fake.requests if p.startswith("/v1/chat"))
    assert body["my_extension"] == {"x": [1, 2]} and body["cache_prompt"] is True


async def test_header_injection_does_not_reach_the_server(make: Maker) -> None:
    fake, proxy = await make()
    host, port = proxy.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nX-A: one\rInjected: two\r\n"
        b"X-B: three\nAlso-Injected: four\r\nConnection: close\r\n\r\n"
    )
    await writer.drain()
    response = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    assert response.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400"))  # refused by the parser
    assert not [r for r in fake.requests if r[1] == "/v1/models"]
    status, body, _ = await chat(proxy, conv(1))
    assert status == 200
