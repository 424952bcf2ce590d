"""llama-server's start-up, shared by managed mode, the benchmarks and the test suite: a
server that dies at warm-up with SIGILL, or with SIGSEGV on a CPU listing AMX (ggml's AMX
kernels on some Intel VMs), is started again with --no-repack, once per binary and CPU, and a
death says its cause before its last lines (or that it wrote none)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import orjson
import pytest
from kvproxy_bench.arms import BenchEnv, DirectArm

from kvproxy.server import startup
from kvproxy.server.managed import ManagedServer, ServerError, free_port
from kvproxy.server.modelinfo import read_model_info
from kvproxy.server.startup import (
    NO_REPACK,
    Exit,
    Quirks,
    cause_line,
    machine_key,
    read_cpu_flags,
    retry_flags,
)

from .conftest import start_real_server
from .standin_server import (
    ALWAYS_DIES,
    DIES_UNLESS_NO_REPACK,
    REPLY,
    SEGV_ALWAYS,
    SEGV_SILENTLY,
    SEGV_UNLESS_NO_REPACK,
    standin_binary,
    starts,
)

AMX_CPU = frozenset({"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
AMD_CPU = frozenset({"avx2", "avx512f", "sse4_2"})
SIGILL = Exit(-4)
SIGSEGV = Exit(-11)


def cpuinfo(directory: Path, flags: frozenset[str]) -> Path:
    """A /proc/cpuinfo as Linux writes it, listing `flags`."""
    path = directory / f"cpuinfo-{len(flags)}"
    path.write_text(
        "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\n"
        f"flags\t\t: fpu {' '.join(sorted(flags))}\nbugs\t\t: spectre_v1\n\n"
    )
    return path


@pytest.fixture
def amx_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """This process reads a CPU that lists AMX (this machine's may not)."""
    path = cpuinfo(tmp_path, AMX_CPU)
    monkeypatch.setattr(startup, "CPUINFO", path)
    return path


@pytest.fixture
def amd_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = cpuinfo(tmp_path, AMD_CPU)
    monkeypatch.setattr(startup, "CPUINFO", path)
    return path


# --- the decisions, on plain data


def test_sigill_is_named_and_retried_with_no_repack_once() -> None:
    assert SIGILL.signal_name == "SIGILL"
    assert retry_flags(SIGILL, ["llama-server", "-m", "m.gguf"]) == [NO_REPACK]
    assert retry_flags(SIGILL, ["llama-server", NO_REPACK]) is None
    assert retry_flags(Exit(1), ["llama-server"]) is None
    assert retry_flags(Exit(-9), ["llama-server"]) is None
    assert Exit(1).signal_name is None


def test_sigsegv_is_the_amx_quirk_only_on_a_cpu_listing_amx() -> None:
    assert SIGSEGV.signal_name == "SIGSEGV"
    assert retry_flags(SIGSEGV, ["llama-server"], AMX_CPU) == [NO_REPACK]
    assert retry_flags(SIGSEGV, ["llama-server", NO_REPACK], AMX_CPU) is None
    assert retry_flags(SIGSEGV, ["llama-server"], AMD_CPU) is None  # another crash
    assert retry_flags(SIGILL, ["llama-server"], AMD_CPU) == [NO_REPACK]
    amx = cause_line(SIGSEGV, ["llama-server"], AMX_CPU)
    assert "SIGSEGV" in amx and "amx_tile" in amx and NO_REPACK in amx and "\n" not in amx
    assert "amx" not in cause_line(SIGSEGV, ["llama-server"], AMD_CPU)
    assert NO_REPACK not in cause_line(SIGSEGV, ["llama-server", NO_REPACK], AMX_CPU)


def test_cause_lines_name_the_signal_the_story_and_the_fix() -> None:
    amx = cause_line(SIGILL, ["llama-server"], AMX_CPU)
    assert "SIGILL" in amx and "amx_int8" in amx and NO_REPACK in amx
    again = cause_line(SIGILL, ["llama-server", NO_REPACK], AMX_CPU)
    assert "rebuild" in again
    other_cpu = cause_line(SIGILL, ["llama-server"], frozenset({"avx2"}))
    assert "amx" not in other_cpu and NO_REPACK in other_cpu
    assert "OOM" in cause_line(Exit(-9), [], AMX_CPU)
    assert "exited with 1" in cause_line(Exit(1), [], AMX_CPU)
    assert "\n" not in amx


def test_cpu_flags_and_quirks_file(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 amx_tile\nbugs\t: x\n")
    assert read_cpu_flags(cpuinfo) == frozenset({"fpu", "avx2", "amx_tile"})
    assert read_cpu_flags(tmp_path / "none") == frozenset()

    binary = tmp_path / "llama-server"
    binary.write_text("v1")
    key = machine_key(binary, AMX_CPU)
    assert key != machine_key(binary, frozenset({"avx2"}))
    quirks = Quirks(tmp_path / "q" / "quirks.json")
    assert quirks.flags(key) == []
    quirks.remember(key, [NO_REPACK])
    assert Quirks(quirks.path).flags(key) == [NO_REPACK]
    binary.write_text("v2, rebuilt")  # another size: asked again
    assert Quirks(quirks.path).flags(machine_key(binary, AMX_CPU)) == []
    quirks.path.write_text("{not json")
    assert quirks.flags(key) == []  # a damaged file only costs a failed attempt


# --- the one start-up path, with a stand-in binary that dies as llama-server does


async def health(url: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(url + "/health") as resp:
        return resp.status


def managed_standin(tmp_path: Path, mode: str) -> tuple[ManagedServer, Path]:
    binary, record = standin_binary(tmp_path, mode)
    port = free_port()
    command = [str(binary), "--model", "m.gguf", "--port", str(port)]
    server = ManagedServer(command, port, quirks=Quirks(tmp_path / "quirks.json"))
    return server, record


@pytest.mark.parametrize(
    ("mode", "signal_name"),
    [(DIES_UNLESS_NO_REPACK, "SIGILL"), (SEGV_UNLESS_NO_REPACK, "SIGSEGV")],
)
async def test_a_warm_up_death_on_an_amx_cpu_is_retried_with_no_repack_and_remembered(
    tmp_path: Path, amx_cpu: Path, caplog: pytest.LogCaptureFixture, mode: str, signal_name: str
) -> None:
    server, record = managed_standin(tmp_path, mode)
    await server.start(timeout=30)
    try:
        assert NO_REPACK in server.command
        assert await health(server.url) == 200
        assert [NO_REPACK in argv for argv in starts(record)] == [False, True]
    finally:
        await server.stop()
    said = [r.getMessage() for r in caplog.records if "starting it again" in r.getMessage()]
    assert len(said) == 1 and signal_name in said[0] and "amx_tile" in said[0], said

    again, _ = managed_standin(tmp_path, mode)
    await again.start(timeout=30)
    await again.stop()
    # The second start knew: one attempt, with the flag.
    assert [NO_REPACK in argv for argv in starts(record)] == [False, True, True]


async def test_a_sigsegv_at_warm_up_on_a_cpu_without_amx_is_not_retried(
    tmp_path: Path, amd_cpu: Path
) -> None:
    server, record = managed_standin(tmp_path, SEGV_UNLESS_NO_REPACK)
    with pytest.raises(ServerError) as err:
        await server.start(timeout=30)
    first, _, rest = str(err.value).partition("\n")
    assert "SIGSEGV" in first and "crashed" in first and NO_REPACK not in first
    assert rest.startswith("its last lines:") and "llama threadpool init" in rest
    assert len(starts(record)) == 1


async def test_a_server_that_keeps_faulting_on_an_amx_cpu_is_tried_twice(
    tmp_path: Path, amx_cpu: Path
) -> None:
    server, record = managed_standin(tmp_path, SEGV_ALWAYS)
    with pytest.raises(ServerError) as err:
        await server.start(timeout=30)
    assert "SIGSEGV" in str(err.value).partition("\n")[0]
    assert [NO_REPACK in argv for argv in starts(record)] == [False, True]


async def test_a_death_with_no_line_says_so_instead_of_an_empty_list(
    tmp_path: Path, amd_cpu: Path
) -> None:
    server, _ = managed_standin(tmp_path, SEGV_SILENTLY)
    with pytest.raises(ServerError) as err:
        await server.start(timeout=30)
    lines = str(err.value).splitlines()
    assert "SIGSEGV" in lines[0]
    assert len(lines) == 2 and "wrote no line" in lines[1], lines


async def test_a_server_that_always_dies_says_why_before_its_last_lines(tmp_path: Path) -> None:
    server, record = managed_standin(tmp_path, ALWAYS_DIES)
    with pytest.raises(ServerError) as err:
        await server.start(timeout=30)
    first, _, rest = str(err.value).partition("\n")
    assert "SIGILL" in first and "illegal instruction" in first and "rebuild" in first
    assert "llama threadpool init" in rest
    assert len(starts(record)) == 2  # the plain start, then one with --no-repack


def test_the_real_server_fixture_goes_through_the_same_path(
    tmp_path: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    binary, record = standin_binary(tmp_path, DIES_UNLESS_NO_REPACK)
    cache = tmp_path / "cache"
    cache.mkdir()
    server = start_real_server(cache, tiny_models["dense"], server_bin=binary)
    try:
        assert NO_REPACK in server.managed.command
        assert len(starts(record)) == 2
    finally:
        server.stop()


async def test_the_benchmarks_go_through_the_same_path(
    tmp_path: Path, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    binary, record = standin_binary(tmp_path, DIES_UNLESS_NO_REPACK)
    model = tiny_models["dense"]
    env = BenchEnv(binary, model, read_model_info(model), tmp_path / "bench", threads=1)
    arm = DirectArm(env, slots=1, ctx_per_slot=256, ram_cache=False)
    async with arm:
        assert arm.server is not None and NO_REPACK in arm.server.command
        assert await health(arm.url) == 200
    assert len(starts(record)) == 2


# `python -m kvproxy.cli ARGS…` on a CPU whose /proc/cpuinfo is the file given first.
ON_CPU = (
    "import sys; from pathlib import Path; import kvproxy.server.startup as s; "
    "s.CPUINFO = Path(sys.argv.pop(1)); from kvproxy.cli import main; sys.exit(main())"
)


def serve(
    tmp_path: Path,
    binary: Path,
    model: Path,
    port: int,
    stdout: int = subprocess.PIPE,
    cpu: Path | None = None,
) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    python = (
        [sys.executable, "-c", ON_CPU, str(cpu)] if cpu else [sys.executable, "-m", "kvproxy.cli"]
    )
    command = [*python, "serve", "--model", str(model)]
    command += ["--server-bin", str(binary), "--port", str(port)]
    command += ["--cache-dir", str(tmp_path / "cache"), "--server-start-timeout", "60"]
    return subprocess.Popen(command, env=env, stdout=stdout, stderr=subprocess.STDOUT)


@pytest.mark.parametrize("mode", [DIES_UNLESS_NO_REPACK, SEGV_UNLESS_NO_REPACK])
def test_managed_mode_starts_a_server_that_needs_no_repack(
    tmp_path: Path, tiny_models: dict[str, Path], mode: str
) -> None:
    binary, record = standin_binary(tmp_path, mode)
    port = free_port()
    proc = serve(tmp_path, binary, tiny_models["dense"], port, cpu=cpuinfo(tmp_path, AMX_CPU))
    try:
        body = orjson.dumps({"messages": [{"role": "user", "content": "hi"}]})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                with urllib.request.urlopen(request, timeout=5) as resp:
                    reply = orjson.loads(resp.read())
                break
            except OSError:
                assert time.monotonic() < deadline, "kvproxy never answered"
                time.sleep(0.2)
        assert reply["choices"][0]["message"]["content"] == REPLY
        assert [NO_REPACK in argv for argv in starts(record)] == [False, True]
    finally:
        proc.terminate()
        proc.wait(30)


def test_managed_mode_names_the_cause_when_the_server_cannot_start(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    binary, _ = standin_binary(tmp_path, ALWAYS_DIES)
    proc = serve(tmp_path, binary, tiny_models["dense"], free_port())
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1
    text = out.decode()
    cause = next(line for line in text.splitlines() if line.startswith("kvproxy: llama-server"))
    assert "SIGILL" in cause and "illegal instruction" in cause
    assert text.index(cause) < text.rindex("llama-server| llama threadpool init")
