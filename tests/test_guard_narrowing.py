"""The ineffective-restore guard narrows to what it proved: restores the server did not reuse
stop those entries, or the older entries of that kind of conversation, for that start of the
server; new conversations are saved and restored as before.

A server restarted with a setting no fingerprint shows (a template change kvproxy cannot see,
say) reuses nothing of the states saved before; kvproxy restores three, finds each wasted,
and from then on leaves the old states alone. What the server saves from then on it reuses,
and kvproxy keeps restoring those.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from kvproxy_fake.model import N_VOCAB
from kvproxy_fake.server import FakeSlot

from kvproxy.cache.decisions.policy import INEFFECTIVE_LIMIT
from kvproxy.cache.reports.explain import wasted_hint
from kvproxy.server.modelinfo import ModelInfo

from .conftest import committed, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then


class ChangedSince(FakeLlamaServer):
    """Restores the states of `stale` keys as other tokens than they were saved with: the
    server computes those conversations otherwise now, and reuses none of a restored one."""

    def __init__(self, stale: set[str], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.stale = stale

    def _restore(self, slot: FakeSlot, id_slot: int, filename: str) -> tuple[int, Any]:
        status, body = super()._restore(slot, id_slot, filename)
        if status == 200 and filename.split(".")[0] in self.stale:
            slot.tokens = [(t + 1) % N_VOCAB for t in slot.tokens]
        return status, body


async def test_wasted_restores_of_old_states_leave_new_conversations_cached(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    old = range(1, INEFFECTIVE_LIMIT + 2)
    async with FakeLlamaServer(slot_save_path=cache) as fake:
        proxy = await start_proxy(fake.url, cache, write_through=True)
        try:
            replies = {n: (await chat(proxy, conv(n)))[1] for n in old}
            await settle(proxy)
        finally:
            await proxy.stop()
    saved = committed(cache)
    async with ChangedSince(saved, slot_save_path=cache) as fake:
        proxy = await start_proxy(fake.url, cache, write_through=True)
        try:
            with caplog.at_level(logging.WARNING, "kvproxy.cache"):
                wasted = [
                    (await chat(proxy, then(conv(n), replies[n])))[2]["X-KVProxy-Cache"]
                    for n in old
                ]
            # New conversations, each saved, evicted by the next two, and continued.
            fresh = {n: (await chat(proxy, conv(n)))[1] for n in (10, 11, 12, 13)}
            await settle(proxy)
            back = [
                (await chat(proxy, then(conv(n), fresh[n])))[2]["X-KVProxy-Cache"] for n in (10, 11)
            ]
        finally:
            await proxy.stop()
    assert wasted == ["restored"] * INEFFECTIVE_LIMIT + ["miss"], "then old states are left"
    assert back == ["restored", "restored"]
    warned = [r.getMessage() for r in caplog.records if "reused none" in r.getMessage()]
    assert len(warned) == 1 and "--swa-full" not in warned[0]


def test_the_hint_suggests_swa_full_only_to_a_sliding_window_model_without_it() -> None:
    gemma = ModelInfo(Path("g.gguf"), "gemma3", 512, True, model_class="swa")
    llama = ModelInfo(Path("l.gguf"), "llama", model_class="dense")
    assert "--swa-full" in wasted_hint(gemma, False, older=False)
    assert "--swa-full" in wasted_hint(gemma, None, older=False)  # flags not known
    assert "--swa-full" not in wasted_hint(gemma, True, older=False)
    assert "--swa-full" not in wasted_hint(llama, False, older=False)
    assert "--swa-full" not in wasted_hint(gemma, False, older=True)
