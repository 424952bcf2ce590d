"""`kvproxy serve --model default`: one command starts llama-server, proxies, and cleans up."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TypeAlias

import openai
import orjson
import pytest
from openai.types.chat import ChatCompletionMessageParam

from kvproxy.server.managed import free_port

pytestmark = pytest.mark.real

# The running `kvproxy serve --model default`: its process, port, llama-server URL and log.
Managed: TypeAlias = tuple[subprocess.Popen[str], int, str, Path]


def wait_ready(proc: subprocess.Popen[str], log: Path, port: int, timeout: float = 240) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"kvproxy exited early:\n{log.read_text()[-3000:]}")
        text = log.read_text()
        if "kvproxy ready" in text:
            match = re.search(r"llama-server is up at (http://[\d.:]+)", text)
            assert match, text[-2000:]
            return match.group(1)
        time.sleep(0.2)
    raise AssertionError(f"kvproxy not ready:\n{log.read_text()[-3000:]}")


def start_managed(cache: Path, log: Path, port: int, *flags: str) -> subprocess.Popen[str]:
    with open(log, "a") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvproxy.cli",
                "serve",
                "--model",
                "default",
                "--port",
                str(port),
                "--cache-dir",
                str(cache),
                "--ctx-size",
                "2048",
                *flags,
                "--",
                "--cache-ram",
                "0",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )


@pytest.fixture
def managed(tmp_path: Path) -> Iterator[Managed]:
    port = free_port()
    log = tmp_path / "kvproxy.log"
    proc = start_managed(tmp_path / "cache", log, port)
    try:
        server_url = wait_ready(proc, log, port)
        yield proc, port, server_url, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def server_pid(port: str) -> int:
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"llama-server") and port.encode() in argv:
                return int(entry.name)
    raise AssertionError("llama-server process not found")


def server_alive(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return True
    except (urllib.error.URLError, OSError):
        return False


def test_serve_default_answers_like_the_server_and_stops_it(managed: Managed) -> None:
    proc, port, server_url, log = managed
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Count to five."}]
    answers = []
    for base in (f"http://127.0.0.1:{port}/v1", server_url + "/v1"):
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        done = client.chat.completions.create(
            model="m", messages=messages, temperature=0, max_tokens=16
        )
        streamed = "".join(
            e.choices[0].delta.content or ""
            for e in client.chat.completions.create(
                model="m", messages=messages, temperature=0, max_tokens=16, stream=True
            )
            if e.choices
        )
        answers.append((done.choices[0].message.content, streamed))
    assert answers[0] == answers[1] and answers[0][0] == answers[0][1] and answers[0][0]
    text = log.read_text()
    assert "llama-server|" in text  # the server's log is relayed with a prefix
    assert "--slot-save-path" in text and "--parallel 2" in text
    assert "--swa-full" in text  # Gemma 3 is a sliding-window model

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert not server_alive(server_url), "llama-server outlived kvproxy"


def test_a_server_that_dies_is_started_again_on_its_port(managed: Managed) -> None:
    proc, port, server_url, log = managed
    pid = server_pid(server_url.rsplit(":", 1)[1])
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while not (server_alive(server_url) and "starting it again" in log.read_text()):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.2)
    text = log.read_text()
    assert "llama-server was killed by SIGKILL (exit -9)" in text and "its last lines" in text
    assert server_pid(server_url.rsplit(":", 1)[1]) != pid
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
    done = client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert done.choices[0].message.content is not None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0


def test_two_servers_one_killed_keeps_serving_and_its_conversation_comes_back(
    tmp_path: Path,
) -> None:
    port = free_port()
    log = tmp_path / "kvproxy.log"
    cache = tmp_path / "cache"
    proc = start_managed(cache, log, port, "--servers", "2", "--idle-save-after", "1")
    try:
        wait_ready(proc, log, port)
        urls = re.findall(r"llama-server is up at (http://[\d.:]+)", log.read_text())
        assert len(set(urls)) == 2, log.read_text()[-3000:]
        base = f"http://127.0.0.1:{port}"
        messages: list[ChatCompletionMessageParam] = [
            {"role": "system", "content": "You answer briefly. " + "Facts: the sky is blue. " * 60},
            {"role": "user", "content": "What colour is the sky?"},
        ]
        client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        first = client.chat.completions.with_raw_response.create(
            model="m", messages=messages, temperature=0, max_tokens=8
        )
        reply = first.parse().choices[0].message.content or ""
        # Saved by its idle save (--idle-save-after 1): on the shared cache dir.
        deadline = time.monotonic() + 60
        home = None
        while home is None:
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            with urllib.request.urlopen(base + "/kvproxy/stats", timeout=5) as r:
                stats = orjson.loads(r.read())
            home = next(
                (s["backend"] for s in stats["slots"] if s["n_tokens"] and s["saved"]), None
            )
            time.sleep(0.2)
        pid = server_pid(home.rsplit(":", 1)[1])
        os.kill(pid, signal.SIGKILL)
        # Turn 2 at once: the other server restores it from the shared cache dir.
        turn2: list[ChatCompletionMessageParam] = [
            *messages,
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And the grass?"},
        ]
        second = client.chat.completions.with_raw_response.create(
            model="m", messages=turn2, temperature=0, max_tokens=8
        )
        assert second.http_response.status_code == 200
        assert second.headers["X-KVProxy-Cache"] == "restored", log.read_text()[-3000:]
        timings = orjson.loads(second.http_response.content)["timings"]
        assert timings["cache_n"] > 300
        # The killed server is started again on its port; kvproxy never stopped serving.
        deadline = time.monotonic() + 120
        while not server_alive("http://" + home):
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.2)
        assert "starting it again" in log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert not any(server_alive(url) for url in urls)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_server_that_cannot_start_is_reported(tmp_path: Path) -> None:
    fake_bin = tmp_path / "llama-server"
    fake_bin.write_text("#!/bin/sh\necho 'error: unknown argument --bogus'\nexit 3\n")
    fake_bin.chmod(0o755)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvproxy.cli",
            "serve",
            "--model",
            str(model),
            "--server-bin",
            str(fake_bin),
            "--cache-dir",
            str(tmp_path / "c"),
            "--port",
            str(free_port()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "llama-server exited with 3" in proc.stderr
    assert "unknown argument --bogus" in proc.stderr


def gone(pid: int) -> bool:
    """The process has ended: no entry, or a zombie its new parent (init, once kvproxy was
    killed) has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_a_server_left_by_a_killed_kvproxy_is_stopped_at_the_next_start(
    managed: Managed, tmp_path: Path
) -> None:
    proc, port, server_url, log = managed
    pid = server_pid(server_url.rsplit(":", 1)[1])
    proc.kill()  # SIGKILL: kvproxy gets no chance to stop its server
    proc.wait()
    time.sleep(0.5)
    assert server_alive(server_url), "the fault is gone: the server died with kvproxy"

    log.write_text("")
    again = start_managed(tmp_path / "cache", log, port)
    try:
        new_url = wait_ready(again, log, port)
        assert not server_alive(server_url) and gone(pid)
        assert f"stopping llama-server pid {pid}" in log.read_text()
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        done = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert done.choices[0].message.content is not None
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0
        assert not server_alive(new_url)
        assert not (tmp_path / "cache" / "llama-server.json").exists()
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
