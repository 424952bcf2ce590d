"""Text completions through kvproxy against a real llama-server, with the OpenAI SDK's
completions API and the server's `/completion`: the same prompt again reuses all of it (as
the server alone does), two prompts alternating on two slots each keep theirs, and a prompt
evicted from its slot comes back from disk."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from .conftest import RealServer, RunningProxy, start_proxy
from .test_cache import settle

pytestmark = pytest.mark.real


def document(name: str) -> str:
    return f"Notes on {name}.\n" + f"The {name} report lists figures for each quarter. " * 40


@pytest.fixture
async def rproxy(real_server: RealServer, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    running = await start_proxy(real_server.url, real_server.cache_dir)
    yield running
    await running.stop()


async def complete(base: str, prompt: str) -> tuple[dict[str, Any], str]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            base + "/completion",
            json={"prompt": prompt, "n_predict": 4, "temperature": 0, "cache_prompt": True},
        ) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json(), r.headers.get("X-KVProxy-Cache", "")


async def test_the_same_prompt_twice_reuses_it_as_the_server_alone_does(
    real_server: RealServer, rproxy: RunningProxy
) -> None:
    text = document("harbour")
    first, _ = await complete(rproxy.url, text)
    await settle(rproxy)
    again, label = await complete(rproxy.url, text)
    assert label == "resident"
    n_prompt = first["timings"]["prompt_n"] + first["timings"]["cache_n"]
    assert again["timings"]["cache_n"] >= n_prompt - 1


async def test_alternating_prompts_and_an_eviction_through_the_sdk(
    real_server: RealServer, rproxy: RunningProxy
) -> None:
    client = openai.AsyncOpenAI(base_url=rproxy.url + "/v1", api_key="none", max_retries=0)
    texts = [document(n) for n in ("harbour", "orchard", "quarry")]
    async with client:

        async def ask(prompt: str) -> Any:
            raw = await client.completions.with_raw_response.create(
                model="any", prompt=prompt, max_tokens=4, temperature=0
            )
            await settle(rproxy)
            return raw.parse(), raw.headers.get("X-KVProxy-Cache")

        for text in texts[:2]:
            await ask(text)
        for text in texts[:2]:  # each on its own slot still
            done, label = await ask(text + " Summary:")
            assert label == "resident"
            assert done.usage.prompt_tokens - done.model_extra["timings"]["cache_n"] <= 8
        await ask(texts[2])  # takes the least recently used slot: the first prompt's
        done, label = await ask(texts[0] + " Summary:")
        assert label in ("resident", "restored")
        assert done.usage.prompt_tokens - done.model_extra["timings"]["cache_n"] <= 8
