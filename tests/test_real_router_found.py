"""`kvproxy serve --models-dir DIR`, a real llama-server router: a GGUF file copied into the
models dir while kvproxy runs is served cached once the router has read its dir again (GET
/models?reload=1, the operator's, through kvproxy), without restarting kvproxy; its saved
entries name it in `kvproxy ls`."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from kvproxy.cli import main

from .test_cache import chat, then
from .test_real_router import FILLER, get_json, serve_models, stop

pytestmark = pytest.mark.real


def test_a_model_copied_into_the_models_dir_later_is_cached_without_a_restart(
    tmp_path: Path, tiny_models: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    shutil.copy(tiny_models["dense"], models / "tiny.gguf")
    running = serve_models(tmp_path, models)
    proxy = SimpleNamespace(url=f"http://127.0.0.1:{running.port}")
    try:
        shutil.copy(tiny_models["dense"], models / "late.gguf")
        listed = get_json(proxy.url + "/models?reload=1")["data"]
        assert {m["id"] for m in listed} == {"tiny", "late"}
        first = [
            {"role": "system", "content": "Answer briefly. " + FILLER * 12},
            {"role": "user", "content": "Which animal jumps?"},
        ]

        async def run() -> tuple[dict[str, str], dict[str, Any], dict[str, str]]:
            status, r1, h1 = await chat(proxy, first, model="late", max_tokens=4)
            assert status == 200, r1
            status, r2, h2 = await chat(proxy, then(first, r1), model="late", max_tokens=4)
            assert status == 200, r2
            return h1, r2, h2

        h1, r2, h2 = asyncio.run(run())
        assert h1["X-KVProxy-Cache"] == "miss"
        assert h2["X-KVProxy-Cache"] == "resident", h2
        assert r2["timings"]["cache_n"] > 256 > r2["timings"]["prompt_n"]
    finally:
        stop(running)  # SIGTERM: kvproxy saves the idle slot first
    assert running.proc.returncode == 0
    assert main(["ls", "--json", "--cache-dir", str(running.cache)]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed and {e["model"] for e in listed} == {"late"}, listed
