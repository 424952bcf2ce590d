"""`kvproxy doctor`: each check's verdict and fix, against the real server and the fake one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvproxy.cli import main
from kvproxy.config import Settings
from kvproxy.server.checks import Check
from kvproxy.server.doctor import diagnose
from kvproxy.server.managed import free_port

from .conftest import RealServer, start_proxy, start_real_server
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then


def by_name(checks: list[Check]) -> dict[str, Check]:
    return {c.name: c for c in checks}


def doctor_json(
    capsys: pytest.CaptureFixture[str], *args: str
) -> tuple[int, dict[str, dict[str, Any]]]:
    code = main(["doctor", "--json", *args])
    out = capsys.readouterr().out
    return code, {c["name"]: c for c in json.loads(out)}


async def run_doctor(fake: FakeLlamaServer, cache: Path, **extra: Any) -> dict[str, Check]:
    settings = Settings(upstream=fake.url, cache_dir=cache, **extra)
    return by_name(await diagnose(settings))


# --- the real server


@pytest.mark.real
def test_a_good_setup_passes(real_server: RealServer, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["doctor", "--upstream", real_server.url, "--cache-dir", str(real_server.cache_dir)]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    for name in (
        "server",
        "API key",
        "model class",
        "slots",
        "slot save path",
        "restore reuse",
        "RAM prompt cache",  # the session's server runs with --cache-ram 0
    ):
        assert any(line.startswith(name) and " ok " in line for line in out.splitlines()), out
    assert "gemma3: swa (sliding window 512); a restore is reused only with" in out
    assert not list(real_server.cache_dir.glob("*.doctor.tmp"))  # the probes cleaned up


@pytest.mark.real
def test_swa_without_swa_full_fails_with_the_fix(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = start_real_server(cache_dir, extra=("--cache-ram", "0"))
    try:
        code, checks = doctor_json(capsys, "--upstream", server.url, "--cache-dir", str(cache_dir))
    finally:
        server.stop()
    assert code == 1
    reuse = checks["restore reuse"]
    assert reuse["status"] == "fail" and "--swa-full" in reuse["fix"]
    assert checks["slot save path"]["status"] == "ok"


@pytest.mark.real
def test_the_servers_ram_prompt_cache_is_found_and_named(
    cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """llama-server's default `--cache-ram` hands one slot's old prompt to any other request:
    with tenants, an oracle of each other's prompts. /props does not show it; the probe does."""
    server = start_real_server(cache_dir, extra=("--swa-full",))
    try:
        code, checks = doctor_json(capsys, "--upstream", server.url, "--cache-dir", str(cache_dir))
    finally:
        server.stop()
    found = checks["RAM prompt cache"]
    assert found["status"] == "warn" and "--cache-ram 0" in found["fix"], found
    assert code == 0  # a warning: one tenant alone loses nothing to it


@pytest.mark.real
def test_a_save_path_elsewhere_fails(
    real_server: RealServer, cache_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, checks = doctor_json(capsys, "--upstream", real_server.url, "--cache-dir", str(cache_dir))
    assert code == 1
    check = checks["slot save path"]
    assert check["status"] == "fail" and f"--slot-save-path {cache_dir}" in check["fix"]


# --- faults the fake server shows


async def test_no_server(cache_dir: Path) -> None:
    checks = by_name(
        await diagnose(Settings(upstream=f"http://127.0.0.1:{free_port()}", cache_dir=cache_dir))
    )
    assert checks["server"].status == "fail" and "--upstream" in checks["server"].fix
    assert list(checks) == ["server"]


async def test_no_slot_save_path(cache_dir: Path) -> None:
    fake = FakeLlamaServer(slot_save_path=None)
    await fake.start()
    try:
        checks = await run_doctor(fake, cache_dir)
    finally:
        await fake.stop()
    check = checks["slot save path"]
    assert (
        check.status == "fail"
        and check.fix == f"start llama-server with --slot-save-path {cache_dir}"
    )


async def test_api_key_needed_then_accepted(cache_dir: Path) -> None:
    fake = FakeLlamaServer(slot_save_path=cache_dir, api_key="sekrit")
    await fake.start()
    try:
        without = await run_doctor(fake, cache_dir)
        # A budget this machine's free disk holds, whatever it has free.
        with_key = await run_doctor(fake, cache_dir, upstream_api_key="sekrit", max_disk="1GiB")
    finally:
        await fake.stop()
    assert without["API key"].status == "fail" and "--upstream-api-key" in without["API key"].fix
    assert with_key["API key"].status == "ok"
    assert all(c.status == "ok" for c in with_key.values() if c.name != "model class")


async def test_idle_slot_wipe_and_useless_restores_fail(cache_dir: Path) -> None:
    fake = FakeLlamaServer(slot_save_path=cache_dir, wipe_idle_slots=True, reuse="none")
    await fake.start()
    try:
        checks = await run_doctor(fake, cache_dir)
    finally:
        await fake.stop()
    assert checks["idle slots kept"].status == "fail"
    assert "--no-kv-unified" in checks["idle slots kept"].fix
    assert checks["restore reuse"].status == "fail"
    assert checks["model class"].status == "warn"  # the fake's model file is not on disk
    assert not list(cache_dir.iterdir())  # probes leave nothing behind


async def test_one_slot_and_an_open_cache_dir_warn(cache_dir: Path) -> None:
    cache_dir.chmod(0o755)
    fake = FakeLlamaServer(slot_save_path=cache_dir, n_slots=1)
    await fake.start()
    try:
        checks = await run_doctor(fake, cache_dir)
    finally:
        await fake.stop()
    assert checks["slots"].status == "warn" and "-np 2" in checks["slots"].fix
    assert checks["cache dir"].status == "warn" and "chmod 700" in checks["cache dir"].fix
    assert checks["restore reuse"].status == "ok"


async def test_beside_a_running_proxy_the_doctor_leaves_its_slots_alone(cache_dir: Path) -> None:
    """The README calls the commands safe beside a running proxy: the probes that evaluate,
    save and erase slots are skipped with a note while a kvproxy serves from the cache dir,
    and run once it stopped."""
    fake = FakeLlamaServer(slot_save_path=cache_dir)
    await fake.start()
    proxy = await start_proxy(fake.url, cache_dir)
    try:
        messages = conv(1)
        _, reply, _ = await chat(proxy, messages)
        await settle(proxy)
        held = [list(slot.tokens) for slot in fake.slots]
        checks = await run_doctor(fake, cache_dir)
        assert [list(slot.tokens) for slot in fake.slots] == held  # nothing erased
        for name in ("slot save path", "idle slots kept", "restore reuse", "RAM prompt cache"):
            assert checks[name].status == "warn", checks[name]
            assert "a kvproxy is serving from" in checks[name].detail
        assert checks["server"].status == "ok" and checks["slots"].status == "ok"
        status, body, headers = await chat(proxy, then(messages, reply))
        assert status == 200 and headers["X-KVProxy-Cache"] == "resident"
        assert body["timings"]["prompt_n"] < body["timings"]["cache_n"]
    finally:
        await proxy.stop()
    try:
        checks = await run_doctor(fake, cache_dir)  # no proxy: the probes run
    finally:
        await fake.stop()
    assert checks["restore reuse"].status == "ok" and checks["slot save path"].status == "ok"


# --- several servers


async def test_every_server_is_checked_and_whether_they_serve_the_same_model(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    other_dir = tmp_path / "elsewhere"  # a server whose --slot-save-path is not kvproxy's
    other_dir.mkdir(mode=0o700)
    fakes = [
        FakeLlamaServer(slot_save_path=cache),
        FakeLlamaServer(slot_save_path=cache),
        FakeLlamaServer(slot_save_path=other_dir, model_path="/models/other.gguf"),
    ]
    for fake in fakes:
        await fake.start()
    try:
        urls = [f.url for f in fakes]
        same = by_name(await diagnose(Settings(upstream=urls[:2], cache_dir=cache), quick=True))
        names = [u.split("//")[1] for u in urls]
        for name in names[:2]:
            assert same[f"server [{name}]"].status == "ok"
            assert same[f"slot save path [{name}]"].status == "ok"
        assert same["same model"].status == "ok"

        mixed = by_name(await diagnose(Settings(upstream=urls, cache_dir=cache), quick=True))
        # The third writes its states where kvproxy does not read: it fails there.
        assert mixed[f"slot save path [{names[2]}]"].status == "fail"
        assert mixed["same model"].status == "warn"
        assert "other.gguf" in mixed["same model"].detail
    finally:
        for fake in fakes:
            await fake.stop()
