"""pytest plugin loaded into llama.cpp's own server test suite by `tools/differential.py`.

It changes no file of the suite. It patches `utils.ServerProcess.start`/`stop` so that:

- the hub models the suite names (`model_hf_repo`/`model_hf_file`) become local files: a
  tiny random-weight llama (`KVDIFF_TINY`) and the bundled Gemma 3 270M (`KVDIFF_GEMMA`);
- in the `kvproxy` arm the real llama-server starts on a free port (with `--slots` and
  `--slot-save-path`), and kvproxy in sidecar mode takes the test's own port in front of it,
  so every request the test makes goes through kvproxy;
- `ServerPreset.load_all` (the suite's model pre-download) does nothing;
- each test's outcome is appended to `KVDIFF_RESULTS` as one JSON line.

The suite's `filelock` and `wget` imports get small stand-ins when those packages are not
installed (nothing is downloaded: a test that needs a file from the network fails in both arms).

Configuration, all from the environment: KVDIFF_ARM (`direct` | `kvproxy`), KVDIFF_TINY,
KVDIFF_GEMMA, KVDIFF_RESULTS, KVDIFF_WORK (per-test cache dirs and kvproxy logs),
KVDIFF_KVPROXY_ARGS (extra `kvproxy serve` flags, e.g. `--min-tokens 0`),
KVDIFF_KVPROXY_PYTHONPATH (where kvproxy's own code is).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

ARM = os.environ.get("KVDIFF_ARM", "direct")

# Hub model -> local model ("tiny" | "gemma"), matched on `repo` or `repo/file`; anything else
# that names a hub model runs the tiny llama (a test that needs that model's abilities fails
# in both arms, which the run reports but does not count against kvproxy).
GEMMA_REPOS = ("ggml-org/tinygemma3-GGUF", "ggml-org/tinyopenjev-for-testing-gguf")


def _install_stand_ins() -> None:
    try:
        import filelock  # noqa: F401
    except ImportError:
        mod = types.ModuleType("filelock")

        class FileLock:
            def __init__(self, path: str) -> None:
                self.path = path
                self.fd: int | None = None

            def __enter__(self) -> FileLock:
                self.fd = os.open(self.path, os.O_CREAT | os.O_RDWR, 0o644)
                fcntl.flock(self.fd, fcntl.LOCK_EX)
                return self

            def __exit__(self, *exc: object) -> None:
                if self.fd is not None:
                    os.close(self.fd)
                    self.fd = None

        mod.FileLock = FileLock  # type: ignore[attr-defined]
        sys.modules["filelock"] = mod
    try:
        import wget  # noqa: F401
    except ImportError:
        mod = types.ModuleType("wget")

        def download(url: str, out: str | None = None) -> str:
            raise RuntimeError(f"differential run: no network downloads ({url})")

        mod.download = download  # type: ignore[attr-defined]
        sys.modules["wget"] = mod


_install_stand_ins()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _local_model(repo: str | None, file: str | None) -> str:
    name = (repo or "").split(":")[0]
    if name in GEMMA_REPOS:
        return os.environ["KVDIFF_GEMMA"]
    return os.environ["KVDIFF_TINY"]


def _wait_healthy(
    url: str, api_key: str | None, proc: subprocess.Popen[bytes], timeout: float
) -> None:
    import requests

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if requests.get(url, headers=headers, timeout=2).status_code == 200:
                return
        if proc.poll() is not None:
            raise RuntimeError(f"kvproxy died at start-up with {proc.returncode}")
        time.sleep(0.05)
    raise TimeoutError(f"kvproxy was not healthy within {timeout} s")


def _patch(utils: Any) -> None:
    sp = utils.ServerProcess
    original_start = sp.start
    original_stop = sp.stop

    def start(self: Any, timeout_seconds: int = utils.DEFAULT_HTTP_TIMEOUT) -> None:
        if self.model_hf_repo and not self.model_file:
            self.model_file = _local_model(self.model_hf_repo, self.model_hf_file)
            self.model_hf_repo = None
            self.model_hf_file = None
        if self.model_url and not self.model_file:
            self.model_file = _local_model(None, None)
            self.model_url = None
        self.offline = True
        if ARM != "kvproxy":
            original_start(self, timeout_seconds)
            return
        # kvproxy arm: the server behind, kvproxy on the test's port and host(s).
        port, host = self.server_port, self.server_host
        work = Path(os.environ["KVDIFF_WORK"])
        work.mkdir(parents=True, exist_ok=True)
        if not self.slot_save_path:
            self.slot_save_path = tempfile.mkdtemp(prefix="cache-", dir=work)
        cache_dir = self.slot_save_path
        os.makedirs(cache_dir, exist_ok=True)
        upstream_port = _free_port()
        self.server_slots = True
        self.server_port, self.server_host = upstream_port, "127.0.0.1"
        try:
            original_start(self, timeout_seconds)
        finally:
            self.server_port, self.server_host = port, host
        cmd = [
            sys.executable, "-m", "kvproxy", "serve",
            "--upstream", f"http://127.0.0.1:{upstream_port}",
            "--host", host, "--port", str(port), "--cache-dir", cache_dir,
            "--shutdown-timeout", "5",
        ]  # fmt: skip
        if self.api_key:
            cmd += ["--upstream-api-key", self.api_key, "--client-api-keys", self.api_key]
        cmd += shlex.split(os.environ.get("KVDIFF_KVPROXY_ARGS", ""))
        env = dict(os.environ)
        if os.environ.get("KVDIFF_KVPROXY_PYTHONPATH"):
            env["PYTHONPATH"] = os.environ["KVDIFF_KVPROXY_PYTHONPATH"]
        fd, log_name = tempfile.mkstemp(prefix="kvproxy-", suffix=".log", dir=work)
        log = os.fdopen(fd, "wb")
        print(f"tests: starting kvproxy with: {' '.join(cmd)} (log {log_name})")
        self._kvdiff_proxy = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._kvdiff_log = log
        try:
            _wait_healthy(
                self.make_url("/health"), self.api_key, self._kvdiff_proxy, timeout_seconds
            )
        except BaseException:
            _stop_proxy(self)
            original_stop(self)
            raise

    def stop(self: Any) -> None:
        _stop_proxy(self)
        original_stop(self)

    sp.start = start
    sp.stop = stop
    utils.ServerPreset.load_all = staticmethod(lambda: None)


def _stop_proxy(server: Any) -> None:
    proc = getattr(server, "_kvdiff_proxy", None)
    if proc is None:
        return
    server._kvdiff_proxy = None
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
    server._kvdiff_log.close()


def pytest_configure(config: Any) -> None:
    import utils  # the suite's own, from its rootdir

    _patch(utils)


def pytest_runtest_logreport(report: Any) -> None:
    path = os.environ.get("KVDIFF_RESULTS")
    if not path:
        return
    failed_setup = report.when == "setup" and not report.passed
    if report.when != "call" and not failed_setup:
        return
    outcome = report.outcome
    if failed_setup and report.failed:
        outcome = "error"
    why = ""
    if not report.passed:
        text = str(report.longrepr) if report.longrepr is not None else ""
        lines = [ln for ln in text.splitlines() if ln.startswith("E ")] or text.splitlines()[-1:]
        why = " | ".join(ln[1:].strip() if ln.startswith("E ") else ln for ln in lines[:3])[:400]
    row = {"id": report.nodeid, "outcome": outcome, "seconds": round(report.duration, 2)}
    if why:
        row["why"] = why
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")
