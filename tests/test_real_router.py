"""`kvproxy serve --models-dir DIR --models-max 1`: managed mode starts a real llama-server
router over the bundled Gemma and a tiny generated llama; kvproxy's client reaches each
model by name, a slot saved before the router unloads its model is restored after it comes
back, the doctor checks each model, and kvproxy's stop stops the router and its models."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import openai
import pytest

from kvproxy.cli import main
from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.server.api import LlamaClient
from kvproxy.server.managed import free_port
from kvproxy.server.modellist import ModelStatus, is_router, list_models

from .conftest import bundled_model
from .test_cache import chat, then
from .test_managed import wait_ready

pytestmark = pytest.mark.real

FILLER = "The quick brown fox jumps over the lazy dog while the cache keeps every token. "


@dataclass
class Router:
    proc: subprocess.Popen[str]
    port: int  # kvproxy's
    server_url: str
    cache: Path
    log: Path


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=60) as resp:
        return json.loads(resp.read())


def models_dir(root: Path, tiny: Path) -> Path:
    """The bundled Gemma and a tiny generated llama, as a router names them: gemma, tiny."""
    models = root / "models"
    models.mkdir(exist_ok=True)
    for name, target in (("gemma", bundled_model()), ("tiny", tiny)):
        if not (models / f"{name}.gguf").exists():
            (models / f"{name}.gguf").symlink_to(target)
    return models


def serve_models(root: Path, models: Path, *server_args: str) -> Router:
    """`kvproxy serve --models-dir` with --models-max 1, ready (its cache dir: root/cache)."""
    cache = root / "cache"
    port = free_port()
    log = root / f"kvproxy-{port}.log"
    command = [
        sys.executable, "-m", "kvproxy.cli", "serve", "--models-dir", str(models),
        "--models-max", "1", "--port", str(port), "--cache-dir", str(cache),
        "--ctx-size", "4096", "--", "--cache-ram", "0", "--threads", str(os.cpu_count() or 2),
        *server_args,
    ]  # fmt: skip
    # The router also lists the models of the Hugging Face cache: none here.
    env = {**os.environ, "LLAMA_CACHE": str(root / "hf-cache")}
    with open(log, "a") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        server_url = wait_ready(proc, log, port)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return Router(proc, port, server_url, cache, log)


def stop(router: Router) -> None:
    if router.proc.poll() is None:
        router.proc.send_signal(signal.SIGTERM)
        try:
            router.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            router.proc.kill()
            router.proc.wait()


@pytest.fixture(scope="module")
def router(
    tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]
) -> Iterator[Router]:
    root = tmp_path_factory.mktemp("router")
    running = serve_models(root, models_dir(root, tiny_models["dense"]))
    try:
        yield running
    finally:
        stop(running)


def test_managed_mode_starts_a_router_whose_models_get_what_kvproxy_needs(router: Router) -> None:
    assert is_router(get_json(router.server_url + "/props"))
    listed = {m["id"]: m for m in get_json(router.server_url + "/models")["data"]}
    assert set(listed) == {"gemma", "tiny"}
    for model in listed.values():
        args = model["status"]["args"]
        assert args[args.index("--slot-save-path") + 1] == str(router.cache)
        assert args[args.index("--parallel") + 1] == "2"
        assert "--no-kv-unified" in args
        assert "--swa-full" in args  # Gemma 3 has sliding-window layers
    assert get_json(router.server_url + "/props")["max_instances"] == 1


def test_a_slot_saved_before_the_router_unloads_its_model_comes_back(router: Router) -> None:
    async def run() -> tuple[int, int, list[int | None], dict[str, ModelStatus]]:
        upstream = Upstream(router.server_url)
        await upstream.start()
        try:
            gemma = LlamaClient(upstream).for_model("gemma", autoload=True)
            tokens = await gemma.tokenize(FILLER * 8)
            await gemma.evaluate(1, tokens)
            saved = await gemma.save(1, "router-test.bin")
            # A request for the other model: with --models-max 1 the router unloads gemma.
            await LlamaClient(upstream).for_model("tiny", autoload=True).tokenize("hello")
            status = {m.id: m.status for m in await list_models(upstream)}
            # kvproxy's own calls load nothing: gemma's slots are out of reach, not reloaded.
            with pytest.raises(UpstreamError):
                await LlamaClient(upstream).for_model("gemma").slots()
            assert {m.id: m.status for m in await list_models(upstream)}["gemma"] == "unloaded"
            emptied = [s.n_prompt_tokens for s in await gemma.slots()]  # loads it again
            await gemma.restore(1, "router-test.bin")
            timings = await gemma.evaluate(1, [*tokens, *await gemma.tokenize(" More.", False)])
            return saved.n_saved, int(timings.get("cache_n", 0)), emptied, status
        finally:
            await upstream.close()

    n_saved, cache_n, emptied, status = asyncio.run(run())
    assert status == {"gemma": "unloaded", "tiny": "loaded"}
    assert emptied == [None, None]  # loaded again, its slots held nothing
    assert cache_n == n_saved > 100  # every restored token reused
    (router.cache / "router-test.bin").unlink()


def test_the_doctor_checks_each_model(router: Router, capsys: pytest.CaptureFixture[str]) -> None:
    get_json(router.server_url + "/slots?model=gemma")  # gemma loaded, tiny not
    code = main(
        ["doctor", "--json", "--upstream", router.server_url, "--cache-dir", str(router.cache)]
    )
    checks = {c["name"]: c for c in json.loads(capsys.readouterr().out)}
    assert code == 0, checks
    assert checks["router"]["status"] == "ok" and "2 models" in checks["router"]["detail"]
    for name in ("model class", "slots"):
        assert checks[f"gemma: {name}"]["status"] == "ok", checks
    # The kvproxy serving from the cache dir holds conversations in those slots: the probes
    # that use slots leave them alone (test_doctor.py has them run once it stopped).
    for name in ("slot save path", "restore reuse"):
        assert checks[f"gemma: {name}"]["status"] == "warn", checks
        assert "a kvproxy is serving from" in checks[f"gemma: {name}"]["detail"]
    assert checks["tiny: model class"]["detail"].startswith("llama: dense")
    assert checks["tiny: probes"]["status"] == "warn"
    statuses = {
        m["id"]: m["status"]["value"] for m in get_json(router.server_url + "/models")["data"]
    }
    assert statuses == {"gemma": "loaded", "tiny": "unloaded"}  # the doctor loaded nothing


def test_a_conversation_comes_back_restored_after_the_router_swapped_its_model(
    router: Router,
) -> None:
    """The issue's case: ≥ 1,500 tokens on A, requests for B make the router (--models-max 1)
    unload A, and A's next turn is restored with ≥ 99% of what it can reuse from cache."""
    proxy = SimpleNamespace(url=f"http://127.0.0.1:{router.port}")
    story = " ".join(f"Line {i}: {FILLER}" for i in range(90))
    first = [
        {"role": "system", "content": "You answer in one word. " + story},
        {"role": "user", "content": "Which animal jumps?"},
    ]

    async def run() -> tuple[dict[str, Any], dict[str, str], dict[str, Any], dict[str, str]]:
        status, r1, h1 = await chat(proxy, first, model="gemma", max_tokens=8)
        assert status == 200 and h1["X-KVProxy-Cache"] in ("miss", "restored"), h1
        for i in range(2):
            other = [{"role": "user", "content": f"Question {i} for the other model."}]
            status, _, _ = await chat(proxy, other, model="tiny", max_tokens=4)
            assert status == 200
        listed = get_json(router.server_url + "/models")["data"]
        assert {m["id"]: m["status"]["value"] for m in listed}["gemma"] == "unloaded"
        status, r2, h2 = await chat(proxy, then(first, r1), model="gemma", max_tokens=8)
        assert status == 200
        return r1, h1, r2, h2

    r1, _, r2, h2 = asyncio.run(run())
    turn1 = r1["timings"]["cache_n"] + r1["timings"]["prompt_n"]
    assert turn1 >= 1500
    reusable = turn1 + r1["timings"]["predicted_n"]
    cache_n = r2["timings"]["cache_n"]
    print(
        f"\nturn 1: {turn1} prompt tokens; turn 2 after the swap: {cache_n} of {reusable} from cache"
    )
    assert h2["X-KVProxy-Cache"] == "restored", h2
    assert cache_n >= 0.99 * reusable, (r2["timings"], reusable)


def test_a_pass_through_route_naming_the_other_model_loses_no_conversation(
    router: Router,
) -> None:
    """#36: POST /tokenize or GET /props?model= naming the other model makes the router
    (--models-max 1) swap; what the unloaded model held is saved first, so its next turn is
    restored, not a miss."""
    proxy = SimpleNamespace(url=f"http://127.0.0.1:{router.port}")
    story = " ".join(f"Entry {i}: {FILLER}" for i in range(40))
    turns = [
        {"role": "system", "content": "You answer in one word. " + story},
        {"role": "user", "content": "Which dog is lazy?"},
    ]

    async def other_model(s: aiohttp.ClientSession, method: str, route: str) -> None:
        body = {"model": "tiny", "content": "hello"} if method == "POST" else None
        async with s.request(method, proxy.url + route, json=body) as resp:
            assert resp.status == 200, await resp.text()
        listed = get_json(router.server_url + "/models")["data"]
        assert {m["id"]: m["status"]["value"] for m in listed}["gemma"] == "unloaded"

    async def run() -> list[tuple[dict[str, Any], dict[str, str]]]:
        status, reply, headers = await chat(proxy, turns, model="gemma", max_tokens=4)
        assert status == 200
        replies = [(reply, headers)]
        async with aiohttp.ClientSession() as s:
            for method, route in (("POST", "/tokenize"), ("GET", "/props?model=tiny")):
                await other_model(s, method, route)
                turns[:] = then(turns, reply)
                status, reply, headers = await chat(proxy, turns, model="gemma", max_tokens=4)
                assert status == 200
                replies.append((reply, headers))
        return replies

    replies = asyncio.run(run())
    for (before, _), (after, headers) in itertools.pairwise(replies):
        reusable = sum(before["timings"][k] for k in ("cache_n", "prompt_n", "predicted_n"))
        assert headers["X-KVProxy-Cache"] == "restored", headers
        assert after["timings"]["cache_n"] >= 0.99 * reusable, (after["timings"], reusable)


def test_a_request_asking_for_no_load_is_refused_as_the_router_refuses_it(
    router: Router,
) -> None:
    """`?autoload=false` naming the model the router unloaded: its own 400 "model is not
    loaded", and the loaded model keeps its slots (its next turn is resident)."""
    proxy = SimpleNamespace(url=f"http://127.0.0.1:{router.port}")
    turns = [{"role": "user", "content": "Name a dog. " + FILLER}]

    async def run() -> tuple[int, dict[str, Any], dict[str, str]]:
        status, reply, _ = await chat(proxy, turns, model="gemma", max_tokens=4)
        assert status == 200
        async with aiohttp.ClientSession() as s:
            url = proxy.url + "/v1/chat/completions?autoload=false"
            body = {"model": "tiny", "messages": turns, "max_tokens": 4}
            async with s.post(url, json=body) as resp:
                refused = await resp.json()
                assert resp.status == 400, refused
                assert refused["error"]["message"] == "model is not loaded", refused
        return await chat(proxy, then(turns, reply), model="gemma", max_tokens=4)

    status, _, headers = asyncio.run(run())
    assert status == 200 and headers["X-KVProxy-Cache"] == "resident", headers
    listed = get_json(router.server_url + "/models")["data"]
    assert {m["id"]: m["status"]["value"] for m in listed}["tiny"] == "unloaded"


def test_clients_reach_each_model_through_kvproxy_and_stop_stops_them(router: Router) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{router.port}/v1", api_key="none")
    for model in ("tiny", "gemma"):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=8
        )
        assert reply.choices[0].message.content is not None
    router.proc.send_signal(signal.SIGTERM)
    assert router.proc.wait(timeout=60) == 0
    running = subprocess.run(["pgrep", "-f", str(router.cache)], capture_output=True, text=True)
    assert running.stdout == "", running.stdout  # no router, no model server left
