"""The 8B-geometry model `kvproxy bench big` runs (kvproxy_bench.ggufmodels): the real
llama-server loads it, a slot save keeps 128 KiB a token (an 8B's 32 layers × 8 KV heads × 128
dimensions at f16), and a restored state serves the conversation's next turn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvproxy_bench.dialogues import first_turn, next_turn

from .conftest import RealServer, module_server
from .ggufmodels import KV_BYTES_PER_TOKEN_F16, big_model_file

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def big_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealServer]:
    extra = ("--cache-ram", "0")
    with module_server(
        tmp_path_factory, "big-model", big_model_file, slots=2, ctx_per_slot=1024, extra=extra
    ) as server:
        yield server


async def post(base: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s, s.post(base + path, json=body) as r:
        assert r.status == 200, await r.text()
        return dict(await r.json())


async def test_a_save_keeps_an_8b_models_128_kib_a_token(big_server: RealServer) -> None:
    assert KV_BYTES_PER_TOKEN_F16 == 128 * 1024
    url = big_server.url
    messages = first_turn(7, n_facts=4)
    body = {"messages": messages, "temperature": 0, "max_tokens": 4, "id_slot": 0}
    first = await post(url, "/v1/chat/completions", body)
    n_prompt = first["timings"]["prompt_n"]
    assert n_prompt > 150
    saved = await post(url, "/slots/0?action=save", {"filename": "big.kv"})
    per_token = saved["n_written"] / saved["n_saved"]
    # The KV cells plus a header and the token list: within a fraction of a percent.
    assert KV_BYTES_PER_TOKEN_F16 <= per_token < KV_BYTES_PER_TOKEN_F16 * 1.002
    assert (big_server.cache_dir / "big.kv").stat().st_size == saved["n_written"]

    restored = await post(url, "/slots/1?action=restore", {"filename": "big.kv"})
    assert restored["n_restored"] == saved["n_saved"]
    reply = first["choices"][0]["message"]["content"]
    again = {**body, "messages": next_turn(messages, reply, 2), "id_slot": 1}
    turn2 = await post(url, "/v1/chat/completions", again)
    # Served from the restored state: everything before the reply's echo is reused.
    assert turn2["timings"]["cache_n"] >= n_prompt - 1


def test_the_model_is_written_once_per_version(tmp_path: Path) -> None:
    path = big_model_file(tmp_path)
    assert path.name.endswith(".gguf") and path.stat().st_size > 10 * 1024**2
    mtime = path.stat().st_mtime_ns
    assert big_model_file(tmp_path) == path and path.stat().st_mtime_ns == mtime
