"""The fingerprint's parts on plain data, and a model file changed under a running (fake)
server. The real server's cases are in test_real_fingerprint.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kvproxy import keys
from kvproxy.server import kvflags
from kvproxy.server.probe import Behaviour, classify
from kvproxy.server.weights import content_digest

from .conftest import start_proxy
from .fakeserver import FakeLlamaServer
from .ggufmodels import write_dense_llama


def test_a_requests_lora_list_sets_the_scales_the_server_applies() -> None:
    """server-context.cpp construct_lora_list: named adapters get their scale, the others 0;
    no list, or an empty one, leaves the server's own."""
    identity = keys.Identity("m", (1.0, 0.5))
    assert identity.lora_scales({}) == (1.0, 0.5)
    assert identity.lora_scales({"lora": []}) == (1.0, 0.5)
    assert identity.lora_scales({"lora": [{"id": 1, "scale": 0.25}]}) == (0.0, 0.25)
    assert identity.lora_scales({"lora": [{"id": 0, "scale": 1}, {"id": 1, "scale": 0.5}]}) == (
        1.0,
        0.5,
    )
    # As the server reads them: a bad id names no adapter, a bad scale is 0, scales float32.
    assert identity.lora_scales({"lora": [{"id": "0", "scale": 1}]}) == (0.0, 0.0)
    assert identity.lora_scales({"lora": [{"id": 0, "scale": 0.1}]})[0] == 0.10000000149011612
    # The same scales key alike however they were asked for; others not.
    assert identity.for_request({}) == identity.for_request(
        {"lora": [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}]}
    )
    assert identity.for_request({}) != identity.for_request({"lora": [{"id": 0, "scale": 1}]})
    assert keys.Identity("m").for_request({"lora": [{"id": 0, "scale": 1}]}) == "m"


def test_the_kv_flags_of_a_command_line() -> None:
    argv = [
        "llama-server", "-m", "x.gguf", "--port", "8080", "-ctk", "q8_0", "--rope-freq-base=2e4",
        "--swa-full", "--control-vector-layer-range", "3", "9", "-t", "8", "-fa", "on",
    ]  # fmt: skip
    assert kvflags.parse(argv) == [
        ("--model", "x.gguf"),
        ("--cache-type-k", "q8_0"),
        ("--rope-freq-base", "2e4"),
        ("--swa-full", "on"),
        ("--control-vector-layer-range", "3 9"),
        ("--flash-attn", "on"),
    ]
    assert kvflags.from_env({"LLAMA_ARG_SWA_FULL": "1", "LLAMA_ARG_THREADS": "8"}) == [
        ("--swa-full", "1")
    ]


def test_behaviours_within_the_tolerance_share_one_id() -> None:
    a = Behaviour(((5, -1.0), (7, -1.5), (9, -3.0), (11, -3.005)))
    jitter = Behaviour(((5, -1.0004), (7, -1.5003), (11, -3.004), (9, -3.006)))
    edge = Behaviour(((5, -1.0), (7, -1.5), (9, -3.0), (12, -3.006)))  # 11 and 12 swap at the edge
    other = Behaviour(((5, -1.2), (7, -1.5), (9, -3.0), (11, -3.005)))
    assert a.matches(jitter) and a.matches(edge) and not a.matches(other)
    first, known = classify([], a)
    assert classify(known, jitter)[0] == first
    assert classify(known, other)[0] != first


def test_the_content_digest_tells_same_size_weights_apart(tmp_path: Path) -> None:
    a = write_dense_llama(tmp_path / "a.gguf")
    b = write_dense_llama(tmp_path / "b.gguf", seed=3)
    assert a.stat().st_size == b.stat().st_size
    assert content_digest(a) != content_digest(b)
    shutil.copy(a, tmp_path / "c.gguf")
    assert content_digest(a) == content_digest(tmp_path / "c.gguf")


async def test_a_model_file_touched_is_not_a_change_but_a_new_content_is(tmp_path: Path) -> None:
    model = write_dense_llama(tmp_path / "model.gguf")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    async with FakeLlamaServer(slot_save_path=cache, model_path=str(model)) as fake:
        proxy = await start_proxy(fake.url, cache)
        backend = proxy.cache.lanes[0].backend
        try:
            assert backend.disk_enabled
            os.utime(model)  # a backup tool, a `touch`: the same content
            await backend.discover()
            assert backend.disk_enabled and backend.doubt is None
            write_dense_llama(tmp_path / "next.gguf", seed=5)
            os.replace(tmp_path / "next.gguf", model)  # an update, the server not restarted
            await backend.discover()
            assert not backend.disk_enabled and backend.doubt is not None
            assert proxy.stats()["backends"][0]["disk_paused"] == backend.doubt
        finally:
            await proxy.stop()
