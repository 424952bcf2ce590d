"""Work whose length grows with its tokens has no fixed deadline: an evaluation, a save or a
restore takes what the server's speed needs (a 10k-token prefill took 6–8 minutes on a slow
CPU, past the 300 s every other POST of kvproxy's is given). Shown against the fake server
with that deadline made short: the slow evaluation and save still succeed, while a
template call as slow fails, and says why."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.server.api import LlamaClient

from .fakeserver import FakeLlamaServer, tokenize


async def test_slow_evaluations_and_saves_are_not_cut_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every POST of kvproxy's that does not say otherwise gets the fixed deadline: 0.2 s here.
    monkeypatch.setattr(Upstream.post_json, "__defaults__", (0.2,))
    async with FakeLlamaServer(slot_save_path=tmp_path, prompt_delay=0.002) as fake:
        upstream = Upstream(fake.url)
        await upstream.start()
        try:
            client = LlamaClient(upstream)
            tokens = tokenize("x" * 400)  # 400 tokens at 2 ms each: 0.8 s, past the deadline
            timings = await client.evaluate(0, tokens)
            assert timings["prompt_n"] + timings["cache_n"] == len(tokens)
            saved = await client.save(0, "slow.kv")
            assert saved.n_saved == len(tokens)
            fake.template_hold.gate = asyncio.Event()  # the server answers no template now
            with pytest.raises(UpstreamError, match=r"no answer within 0\.2 s"):
                await client.apply_template({"messages": [{"role": "user", "content": "hi"}]})
        finally:
            await upstream.close()
