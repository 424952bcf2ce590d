"""A new user's first hour (#37): mistakes caught at start in one line (flags of the other
mode, a sidecar's cache dir not the server's), managed mode's reply cap, what to install
when a part is missing, and `kvproxy doctor` finding the server `make run` started."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from kvproxy.cli.flags import load_settings
from kvproxy.config import Settings
from kvproxy.edge.app import build_app
from kvproxy.edge.listen import listen, runner_options
from kvproxy.server.managed import free_port, server_command
from kvproxy.server.savepath import PROBE_MARK, probe_name
from kvproxy.store import Store
from kvproxy.wire import with_reply_cap

from .conftest import RealServer, start_proxy
from .fakeserver import FakeLlamaServer, clients
from .test_cache import chat, conv, settle


def test_an_upstream_given_as_the_openai_base_url_is_the_server_address() -> None:
    s = Settings(upstream="http://127.0.0.1:8080/v1/")
    assert s.upstream_urls == ["http://127.0.0.1:8080"]


@pytest.mark.parametrize(
    ("cli", "says"),
    [
        ({"upstream": "http://127.0.0.1:8080", "model": "default"}, "not both"),
        ({"upstream": "http://127.0.0.1:8080", "slots": 4}, "--slots: managed mode only"),
        (
            {"upstream": "http://127.0.0.1:8080", "ctx_size": 4096},
            "--ctx-size: managed mode only",
        ),
    ],
)
def test_flags_of_the_other_mode_are_refused_in_one_line(cli: dict[str, object], says: str) -> None:
    with pytest.raises(SystemExit) as exc:
        load_settings(cli)
    message = str(exc.value)
    assert says in message and "\n" not in message, message


def test_managed_mode_leaves_the_servers_reply_length_alone(tmp_path: Path) -> None:
    """No --n-predict: llama-server would also cut requests asking for more, and give
    /infill prompts less of their extra context (format_prompt_infill)."""
    cmd = server_command(Path("llama-server"), Path("m.gguf"), 1, tmp_path, 2, 256, None, [])
    assert "--n-predict" not in cmd and "-n" not in cmd


def test_the_reply_cap_fills_in_only_a_missing_reply_length() -> None:
    assert with_reply_cap({"messages": []}, 2048) == {"messages": [], "n_predict": 2048}
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens", "n_predict"):
        assert with_reply_cap({field: 5000}, 2048) == {field: 5000}
    assert with_reply_cap({"n_predict": 0}, 2048) == {"n_predict": 0}, "a ring update"
    assert with_reply_cap({"prompt": "x"}, -1) == {"prompt": "x"}
    assert Settings(model="default").request_reply_cap == 2048
    assert Settings(upstream="http://127.0.0.1:8080").request_reply_cap == -1, "sidecar"


def test_a_reply_length_given_to_the_server_is_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvproxy serve -- -n 64`: the user's server flag caps replies, kvproxy adds none over
    it (a filled-in n_predict would win over the server's -n)."""
    for args in (["-n", "64"], ["--n-predict", "64"], ["--predict=64"], ["-c", "4096", "-n", "8"]):
        assert Settings(model="default", server_args=args).request_reply_cap == -1, args
    assert Settings(model="default", server_args=["-c", "4096"]).request_reply_cap == 2048
    monkeypatch.setenv("LLAMA_ARG_N_PREDICT", "64")
    assert Settings(model="default").request_reply_cap == -1


async def test_managed_mode_caps_a_reply_that_sets_no_length(tmp_path: Path) -> None:
    """What the server receives from kvproxy in managed mode (its settings, no --upstream):
    the default cap where the client set none; the client's own length where it did."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    fake = FakeLlamaServer(slot_save_path=cache)
    await fake.start()
    settings = Settings(model="default", cache_dir=cache, port=free_port(), min_tokens=0)
    runner = web.AppRunner(build_app(settings, [fake.url]), **runner_options(settings))
    await runner.setup()
    await listen(runner, settings)
    url = f"http://127.0.0.1:{settings.port}"
    try:
        async with aiohttp.ClientSession() as s:
            chat = {"messages": [{"role": "user", "content": "hi"}]}
            for body in (chat, {**chat, "max_tokens": 5000}, {"prompt": "text"}):
                route = "/completion" if "prompt" in body else "/v1/chat/completions"
                async with s.post(url + route, json=body) as r:
                    assert r.status == 200, await r.text()
        routes = ("/completion", "/v1/chat/completions")
        sent = [b for _, p, b in clients(fake.requests) if p in routes]
        assert sent[0]["n_predict"] == settings.reply_cap
        assert sent[1]["max_tokens"] == 5000 and "n_predict" not in sent[1]
        assert sent[2]["n_predict"] == settings.reply_cap
    finally:
        await runner.cleanup()
        await fake.stop()


def test_serve_help_shows_defaults() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvproxy", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(out.split())
    assert "default 8081" in flat and "default 2048" in flat


def _serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvproxy", "serve", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.real
def test_a_sidecar_whose_cache_dir_is_not_the_servers_does_not_start(
    real_server: RealServer, tmp_path: Path
) -> None:
    mine = tmp_path / "elsewhere"
    mine.mkdir(mode=0o700)
    port = str(free_port())
    run = _serve("--upstream", real_server.url, "--cache-dir", str(mine), "--port", port)
    assert run.returncode != 0, run.stderr
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("kvproxy: llama-server at "), run.stderr
    assert f"start llama-server with --slot-save-path {mine}" in last
    assert "or pass --cache-dir <its --slot-save-path>" in last
    # Its probe is what landed in the server's dir; nothing kvproxy wrote is in its own.
    probes = [p.name for p in real_server.cache_dir.iterdir() if p.name.endswith(PROBE_MARK)]
    assert len(probes) == 1 and probes[0] in last
    assert not any(p.suffix == ".tmp" for p in mine.iterdir())


@pytest.mark.real
def test_a_sidecar_on_the_servers_dir_starts_and_leaves_no_probe(real_server: RealServer) -> None:
    with _kvproxy("--upstream", real_server.url, "--cache-dir", str(real_server.cache_dir)):
        assert not [p for p in real_server.cache_dir.iterdir() if PROBE_MARK in p.name]


@contextlib.contextmanager
def _kvproxy(*args: str) -> Iterator[None]:
    """`kvproxy serve ARGS` until its ready line, then as long as the block runs."""
    cmd = [sys.executable, "-m", "kvproxy", "serve", *args, "--port", str(free_port())]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            if "kvproxy ready" in line:
                break
        else:
            raise AssertionError(f"kvproxy ended: {proc.wait()}")
        # Drained meanwhile: a full pipe would stop kvproxy at its next log line.
        threading.Thread(target=proc.stderr.read, daemon=True).start()
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


async def test_a_save_found_in_another_dir_turns_saving_off(tmp_path: Path) -> None:
    """A sidecar started before its server (not probed) whose dirs differ: its first save
    says so and turns the disk cache off, not one temp file left in the server's dir a save."""
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    theirs.mkdir(mode=0o700)
    mine.mkdir(mode=0o700)
    fake = FakeLlamaServer(slot_save_path=theirs)  # 2 slots
    await fake.start()
    proxy = await start_proxy(fake.url, mine)
    try:
        for n in range(1, 9):  # every new conversation past the second saves a slot first
            assert (await chat(proxy, conv(n)))[0] == 200
            await settle(proxy)
        left = [p.name for p in theirs.iterdir() if not p.name.endswith(PROBE_MARK)]
        # At most the saves already under way when the first found out (one a slot), and the
        # probe save each made to tell another dir from a file removed meanwhile.
        probes = [p.name for p in theirs.iterdir() if p.name.endswith(PROBE_MARK)]
        assert len(left) in (1, 2) and all(name.endswith(".tmp") for name in left), left
        assert len(probes) <= len(left), probes
        assert proxy.stats()["disk_enabled"] is False
    finally:
        await proxy.stop()
        await fake.stop()


def _without(module: str, code: str) -> subprocess.CompletedProcess[str]:
    """`code` run as a user would, with `module` not installed."""
    hide = f"import sys; sys.modules[{module!r}] = None; "
    return subprocess.run(
        [sys.executable, "-c", hide + code], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("scenario", ["restore", "store"])
def test_kvproxy_bench_without_the_benchmarks_says_how_to_install_them(scenario: str) -> None:
    run = _without("kvproxy_bench", f"from kvproxy.cli import main; main(['bench', {scenario!r}])")
    assert run.returncode == 1
    message = run.stderr.strip()
    assert "\n" not in message and message.endswith("pip install -e ./bench`"), message


@pytest.mark.parametrize("example", ["openai_chat.py", "openai_stream.py", "openai_tools.py"])
def test_an_example_without_the_openai_sdk_says_pip_install_openai(example: str) -> None:
    path = Path(__file__).resolve().parent.parent / "examples" / example
    assert "pip install openai" in path.read_text().split('"""')[1]  # its docstring says so
    run = _without("openai", f"import runpy; runpy.run_path({str(path)!r}, run_name='__main__')")
    assert run.returncode == 1
    assert run.stderr.strip().endswith("pip install openai"), run.stderr
    assert "Traceback" not in run.stderr


@pytest.mark.real
def test_doctor_finds_the_server_make_run_started(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    doctor = [sys.executable, "-m", "kvproxy", "doctor", "--cache-dir", str(cache)]
    with _kvproxy("--model", "default", "--slots", "2", "--cache-dir", str(cache)):
        run = subprocess.run(
            [*doctor, "--quick", "--json"], capture_output=True, text=True, timeout=120
        )
        checks = {c["name"]: c for c in json.loads(run.stdout)}
        assert checks["found"]["status"] == "ok", checks
        assert checks["found"]["detail"].startswith("http://127.0.0.1:")
        # Its probe save would act on the running proxy's slots: skipped, with a note.
        assert checks["slot save path"]["status"] == "warn", checks
        assert "a kvproxy is serving from" in checks["slot save path"]["detail"]
        assert run.returncode == 0, checks
    # Once that kvproxy stopped (and its server with it), nothing is found, in one line.
    run = subprocess.run([*doctor, "--quick"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1 and "no kvproxy started one on" in run.stdout


def test_a_probe_file_left_in_a_cache_dir_is_swept_at_start(tmp_path: Path) -> None:
    """The probe a mismatched start left in the server's dir goes once kvproxy uses that dir
    (`--cache-dir <its --slot-save-path>`, the fix it named)."""
    left = tmp_path / probe_name()
    left.write_bytes(b"a probe save")
    Store(tmp_path, ttl=3600, max_bytes=0).open()
    assert not left.exists()
