"""Router mode, against the fake router (bench/kvproxy_fake/router.py): kvproxy's own calls
reach the model they name and load none; GET /models and /models/sse read into records; the
managed command of a models dir; the doctor's checks of each model."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from kvproxy_fake.router import FakeRouter, fake_models

from kvproxy.config import Settings
from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.server.api import LlamaClient, ModelRoute
from kvproxy.server.checks import Check
from kvproxy.server.doctor import diagnose
from kvproxy.server.launch import gguf_files, managed_command
from kvproxy.server.managed import router_command
from kvproxy.server.modellist import (
    ModelEvent,
    RouterModel,
    is_router,
    list_models,
    model_events,
    parse_event,
    read_models,
)

from .conftest import bundled_model
from .ggufmodels import write_dense_llama


@pytest.fixture
async def router(tmp_path: Path) -> AsyncIterator[FakeRouter]:
    cache = tmp_path / "cache"
    cache.mkdir()
    async with FakeRouter(fake_models(["coder", "chat"]), models_max=1, slot_save_path=cache) as r:
        yield r


@pytest.fixture
async def upstream(router: FakeRouter) -> AsyncIterator[Upstream]:
    up = Upstream(router.url)
    await up.start()
    try:
        yield up
    finally:
        await up.close()


def test_a_route_names_its_model_as_the_router_routes_it() -> None:
    route = ModelRoute("org/m:Q4")
    assert route.query("/slots", get=True) == "/slots?model=org%2Fm%3AQ4&autoload=false"
    assert route.query("/slots/0?action=save", get=False) == "/slots/0?action=save&autoload=false"
    assert route.body({"filename": "f"}) == {"filename": "f", "model": "org/m:Q4"}
    assert ModelRoute("m", autoload=True).query("/tokenize", get=False) == "/tokenize?autoload=true"


async def test_every_call_reaches_the_named_model_and_loads_none(
    router: FakeRouter, upstream: Upstream
) -> None:
    root = LlamaClient(upstream)
    assert is_router(await root.props())
    coder = root.for_model("coder")
    # Not loaded: refused, and nothing was loaded for it.
    with pytest.raises(UpstreamError) as refused:
        await coder.slots()
    assert refused.value.status == 400 and "not loaded" in str(refused.value)
    assert router.models["coder"].loads == 0

    await router.load("coder")
    tokens = await coder.tokenize("hello there")
    await coder.evaluate(1, tokens)
    saved = await coder.save(1, "c.bin")
    assert saved.n_saved == len(tokens)
    assert (router.slot_save_path or Path()) / "c.bin"
    slots = await coder.slots()
    assert [s.n_prompt_tokens for s in slots][1] == len(tokens)
    await coder.erase(1)
    restored = await coder.restore(1, "c.bin")
    assert restored.n_restored == len(tokens)
    props = await coder.props()
    assert props["model_path"] == "/models/coder.gguf"
    # Every one of those went to coder's own server, each naming it.
    child = router.child("coder")
    assert {path.split("?")[0] for _, path, _ in child.requests} >= {
        "/tokenize",
        "/completion",
        "/slots/1",
        "/slots",
        "/props",
    }
    posts = [body for method, _, body in child.requests if method == "POST"]
    assert posts and all(body["model"] == "coder" for body in posts)


async def test_a_load_beyond_models_max_unloads_the_least_recently_used(
    router: FakeRouter, upstream: Upstream
) -> None:
    await router.load("coder")
    coder = LlamaClient(upstream).for_model("coder")
    await coder.evaluate(0, await coder.tokenize("kept until the swap"))
    chat = LlamaClient(upstream).for_model("chat", autoload=True)
    await chat.tokenize("this loads chat")
    assert router.unloads == ["coder"]
    models = {m.id: m for m in await list_models(upstream)}
    assert models["coder"].status == "unloaded" and models["chat"].status == "loaded"
    # Back again, coder's slots are empty: the swap threw its KV away.
    await router.load("coder")
    assert all(s.n_prompt_tokens in (None, 0) for s in await coder.slots())


async def test_models_read_into_records(router: FakeRouter, upstream: Upstream) -> None:
    await router.load("chat")
    models = {m.id: m for m in await list_models(upstream)}
    chat, coder = models["chat"], models["coder"]
    assert chat.running and not coder.running
    assert chat.path == "/models/chat.gguf" and coder.path == "/models/coder.gguf"
    assert chat.slot_save_path == str(router.slot_save_path)
    assert chat.n_ctx == 4096 and coder.n_ctx is None
    assert chat.identity() == "/models/chat.gguf|4096|ftype=F16"
    assert chat.names() == {"chat"}


def test_a_model_record_from_the_routers_json() -> None:
    raw = {
        "data": [
            {
                "id": "gemma",
                "aliases": ["g"],
                "status": {
                    "value": "unloaded",
                    "args": ["llama-server", "--model=/m/gemma.gguf", "--slot-save-path", "/c"],
                    "failed": True,
                    "exit_code": 1,
                },
            },
            {"id": "odd", "status": {"value": "rebooting"}},
        ]
    }
    gemma, odd = read_models(raw)
    assert gemma == RouterModel(
        "gemma",
        "unloaded",
        ("llama-server", "--model=/m/gemma.gguf", "--slot-save-path", "/c"),
        ("g",),
        failed=True,
        exit_code=1,
    )
    assert gemma.path == "/m/gemma.gguf" and gemma.slot_save_path == "/c"
    assert odd.status == "unknown" and odd.path == ""
    with pytest.raises(UpstreamError):
        read_models({"models": []})


def test_sse_lines_read_into_events() -> None:
    line = b'data: {"model": "a", "event": "model_status", "data": {"status": "loaded"}}\n'
    assert parse_event(line) == ModelEvent("a", "model_status", "loaded")
    assert parse_event(b'data: {"model": "*", "event": "models_reload"}') == ModelEvent(
        "*", "models_reload"
    )
    assert parse_event(b"\n") is None and parse_event(b"data: {not json") is None


async def test_events_tell_of_loads_and_unloads(router: FakeRouter, upstream: Upstream) -> None:
    seen: list[ModelEvent] = []

    async def watch() -> None:
        async for event in model_events(upstream):
            seen.append(event)

    task = asyncio.create_task(watch())
    await asyncio.sleep(0.1)
    await router.load("coder")
    await router.load("chat")
    for _ in range(50):
        if len(seen) >= 5:
            break
        await asyncio.sleep(0.02)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert [(e.model, e.status) for e in seen] == [
        ("coder", "loading"),
        ("coder", "loaded"),
        ("coder", "unloaded"),
        ("chat", "loading"),
        ("chat", "loaded"),
    ]


# --- managed mode's command


def test_the_router_command_passes_what_every_model_needs(tmp_path: Path) -> None:
    cmd = router_command(
        Path("/bin/llama-server"), tmp_path, 1, 8080, tmp_path / "c", 2, 4096, None, ["-t", "2"]
    )
    assert cmd[:5] == ["/bin/llama-server", "--models-dir", str(tmp_path), "--models-max", "1"]
    assert "--model" not in cmd
    for flag, value in (("--parallel", "2"), ("--ctx-size", "8192")):
        assert cmd[cmd.index(flag) + 1] == value
    assert cmd[cmd.index("--slot-save-path") + 1] == str(tmp_path / "c")
    assert "--no-kv-unified" in cmd and cmd[-2:] == ["-t", "2"]


async def test_a_models_dir_with_a_sliding_window_model_gets_swa_full(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    write_dense_llama(models / "tiny.gguf")
    (models / "gemma").mkdir()
    (models / "gemma" / "gemma.gguf").symlink_to(bundled_model())
    (models / "gemma" / "mmproj-gemma.gguf").write_bytes(b"GGUF")
    assert [p.name for p in gguf_files(models)] == ["gemma.gguf", "tiny.gguf"]
    settings = Settings(models_dir=models, models_max=1, cache_dir=tmp_path / "c")
    launch = await managed_command(settings, Path("/bin/llama-server"), 9000)
    assert "--swa-full" in launch.command and "--models-dir" in launch.command
    only_dense = tmp_path / "dense"
    only_dense.mkdir()
    write_dense_llama(only_dense / "tiny.gguf")
    settings = Settings(models_dir=only_dense, cache_dir=tmp_path / "c")
    launch = await managed_command(settings, Path("/bin/llama-server"), 9000)
    assert "--swa-full" not in launch.command and "--models-max" not in launch.command


# --- the doctor


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


async def test_the_doctor_checks_each_model_of_a_router(router: FakeRouter) -> None:
    await router.load("chat")
    cache = router.slot_save_path
    assert cache is not None
    cache.chmod(0o700)
    checks = by_name(await diagnose(Settings(upstream=router.url, cache_dir=cache)))
    assert checks["router"].status == "ok" and "2 models" in checks["router"].detail
    # The loaded model gets the single-server checks, through its name.
    for name in ("slots", "slot save path", "idle slots kept"):
        assert checks[f"chat: {name}"].status == "ok", checks
    # The unloaded one: what the router will start it with, and no load.
    assert checks["coder: probes"].status == "warn"
    assert "coder: slot save path" not in checks  # its --slot-save-path is the cache dir
    assert router.models["coder"].loads == 0


async def test_the_doctor_names_a_model_saving_elsewhere(tmp_path: Path) -> None:
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir(mode=0o700)
    elsewhere.mkdir()
    async with FakeRouter(fake_models(["m"]), slot_save_path=elsewhere) as router:
        checks = by_name(await diagnose(Settings(upstream=router.url, cache_dir=cache)))
    check = checks["m: slot save path"]
    assert check.status == "fail" and str(elsewhere) in check.detail
    assert f"--slot-save-path {cache}" in check.fix
