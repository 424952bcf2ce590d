"""What kvproxy's sliding-window rule (policy.reuse_rule, `counted`) assumes of the real
server, checked on it: a state saved and restored with --swa-full serves a request that parts
from it less than n_swa tokens before its end, and nothing beyond (the bundled Gemma 3 270M,
n_swa 512). If a llama-server release moves that edge, this fails before kvproxy restores
states the server would not reuse."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from kvproxy.cache.decisions.policy import StoredView, reuse_rule, window_serves
from kvproxy.server.modelinfo import read_model_info

from .conftest import RealServer

pytestmark = pytest.mark.real


async def test_a_restored_swa_state_serves_a_divergence_within_its_window(
    real_server: RealServer,
) -> None:
    info = read_model_info(real_server.model)
    assert info.model_class == "swa" and info.n_swa > 0
    rule = reuse_rule(info.model_class, info.n_swa)
    async with aiohttp.ClientSession() as s:

        async def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
            async with s.post(real_server.url + path, json=body) as r:
                assert r.status == 200, await r.text()
                reply: dict[str, Any] = await r.json()
                return reply

        text = " ".join(f"w{i}" for i in range(700))
        state = (await post("/tokenize", {"content": text}))["tokens"][:1000]
        n = len(state)
        for tail in (rule.counted, info.n_swa + 8):
            await post("/completion", {"prompt": state, "n_predict": 0, "id_slot": 0})
            await post("/slots/0?action=save", {"filename": "window-test.bin"})
            await post("/slots/0?action=erase", {})
            await post("/slots/0?action=restore", {"filename": "window-test.bin"})
            parted = state[: n - tail] + [t + 1 for t in state[n - tail : n - tail + 20]]
            reply = await post(
                "/completion",
                {"prompt": parted, "n_predict": 0, "id_slot": 0, "cache_prompt": True},
            )
            served = reply["timings"]["cache_n"] >= n - tail
            assert served == window_serves(rule, StoredView(1, 0, n), n - tail), (tail, reply)
