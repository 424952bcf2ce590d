"""The status page in headless chromium with a real llama-server behind the proxy (Gemma 3
270M, -np 2): three conversations through two slots, so one is saved and restored; the page
shows both slots' conversations and every decision. The screenshot is kept under the test's
tmp_path; with KVPROXY_SCREENSHOT=1 it also replaces docs/img/status.png (the README's)."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
from kvproxy_bench.dialogues import first_turn

from .browser import screenshot
from .conftest import RealServer, start_proxy
from .test_real_cache import chat, next_turn
from .test_status_page import dump_settled, visible_text

pytestmark = pytest.mark.real

DOCS_IMAGE = Path(__file__).resolve().parents[1] / "docs" / "img" / "status.png"


async def test_status_page_with_a_real_server(real_server: RealServer, tmp_path: Path) -> None:
    proxy = await start_proxy(real_server.url, real_server.cache_dir, min_tokens=64)
    try:
        convs = {c: first_turn(c + 40, n_facts=30) for c in (1, 2, 3)}
        turn1 = {}
        for c in (1, 2, 3):
            turn1[c], headers = await chat(proxy.url, convs[c])
            assert headers["X-KVProxy-Cache"] == "miss"
        seen = set()
        for c in (1, 3):  # 1 was saved to make room for 3: restored; 3 is still resident
            _, headers = await chat(proxy.url, next_turn(convs[c], turn1[c], "And fact 5?"))
            seen.add(headers["X-KVProxy-Cache"])
        assert seen == {"restored", "resident"}
        stats = proxy.stats()
        assert stats["restores"] >= 1 and stats["saves"] >= 1

        url = proxy.url + "/kvproxy/"
        dom, slots = await dump_settled(proxy)
        text = visible_text(dom)
        assert "Cannot reach" not in text and "5 requests since start" in text
        assert "model class" in text and "not known yet" not in text
        for slot in slots:
            assert slot["key"], "both slots hold a conversation"
            assert slot["key"][:12] in text
            assert f"{slot['n_tokens']:,}" in text
        for decision in ("miss", "restored", "resident"):
            assert re.search(rf"<td class=\"d-{decision}\">{decision}</td>", dom), decision
        assert "40.0 %" in text  # hit rate over the last hour: 2 of 5
        shot = tmp_path / "status.png"
        await screenshot(url, shot)
        if os.environ.get("KVPROXY_SCREENSHOT") == "1":
            DOCS_IMAGE.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(shot, DOCS_IMAGE)
    finally:
        await proxy.stop()
