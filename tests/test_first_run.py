"""A new user's first run: what kvproxy says when something is set up wrong names the fix
(the flag, the file), and its command line takes only what it documents."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from kvproxy.cli import main
from kvproxy.cli.flags import load_settings
from kvproxy.server.managed import free_port
from kvproxy.server.modelinfo import ModelInfo, swa_note

from .conftest import Maker, start_proxy
from .fakeserver import FakeLlamaServer
from .test_cache import chat, conv, settle, then
from .test_prompts import complete

SERVER_KEY = {"Authorization": "Bearer sekrit"}


async def test_a_server_with_an_api_key_kvproxy_lacks_is_named_with_the_flag(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The client's key reaches the server, so its chats answer; kvproxy's own calls get 401,
    so caching is off: the warning says which flag turns it on."""
    caplog.set_level(logging.WARNING, logger="kvproxy")
    fake = FakeLlamaServer(slot_save_path=tmp_path, api_key="sekrit")
    await fake.start()
    proxy = await start_proxy(fake.url, tmp_path)
    try:
        status, _, headers = await chat(proxy, conv(1), headers=SERVER_KEY)
        assert status == 200 and headers["X-KVProxy-Cache"] == "bypass"
        said = [r.getMessage() for r in caplog.records if "--api-key" in r.getMessage()]
        assert len(said) == 1 and "--upstream-api-key KEY" in said[0], said
    finally:
        await proxy.stop()
    proxy = await start_proxy(fake.url, tmp_path, upstream_api_key="sekrit")
    try:  # the flag it named: cached
        status, reply, headers = await chat(proxy, conv(1), headers=SERVER_KEY)
        assert status == 200 and headers["X-KVProxy-Cache"] == "miss"
        await settle(proxy)
        _, _, headers = await chat(proxy, then(conv(1), reply), headers=SERVER_KEY)
        assert headers["X-KVProxy-Cache"] == "resident"
    finally:
        await proxy.stop()
        await fake.stop()


SYSTEM = {"role": "system", "content": "You are a helpful assistant. " + "pad " * 300}


async def test_resident_is_only_a_conversations_own_earlier_state(make: Maker) -> None:
    """A new conversation sharing only the system prompt with the slot's is a `miss`, the
    reuse of that opening showing in cache_n; a returning one is `resident`; the same request
    again too (docs/clients.md defines the labels)."""
    _, proxy = await make()
    first = [SYSTEM, {"role": "user", "content": "What is a slot?"}]
    status, reply, headers = await chat(proxy, first)
    assert status == 200 and headers["X-KVProxy-Cache"] == "miss"
    await settle(proxy)
    other = [SYSTEM, {"role": "user", "content": "Something else entirely."}]
    status, body, headers = await chat(proxy, other)
    assert status == 200 and headers["X-KVProxy-Cache"] == "miss", headers
    assert body["timings"]["cache_n"] > 300  # the shared system prompt was reused
    await settle(proxy)
    status, body, headers = await chat(proxy, then(other, body))
    assert headers["X-KVProxy-Cache"] == "resident"
    assert body["timings"]["prompt_n"] < body["timings"]["cache_n"]
    await settle(proxy)
    _, _, headers = await chat(proxy, then(other, body, "Again."))
    _, _, again = await chat(proxy, then(other, body, "Again."))
    assert again["X-KVProxy-Cache"] == "resident"  # the same request again


async def test_a_prompt_sharing_only_its_opening_blocks_is_a_miss(make: Maker) -> None:
    _, proxy = await make(server={"n_slots": 1})  # the one slot: the opening is in it
    opening = "Instructions that every prompt of this tool starts with. " * 20  # ~5 blocks
    first = opening + "The first task, described at length. " * 40
    status, _, label = await complete(proxy.url, first)
    assert status == 200 and label == "miss"
    await settle(proxy)
    status, body, label = await complete(proxy.url, first + " And one more line.")
    assert label == "resident"
    await settle(proxy)
    status, body, label = await complete(proxy.url, opening + "Another task. " * 120)
    assert status == 200 and label == "miss"
    assert body["timings"]["cache_n"] > 200  # the opening was reused


ROOT = Path(__file__).resolve().parents[1]


def test_make_run_and_the_readme_say_where_the_kvproxy_command_is() -> None:
    """After `make run` the command is in the venv, not on PATH: both say so."""
    venv = "/nowhere/venv"  # -n prints what `make run` runs, installs nothing
    done = subprocess.run(
        ["make", "-n", "run", f"VENV={venv}"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done
    said = [line for line in done.stdout.splitlines() if line.startswith("echo")]
    assert len(said) == 1 and f"{venv}/bin/kvproxy" in said[0], done.stdout
    assert f"source {venv}/bin/activate" in said[0]
    readme = (ROOT / "README.md").read_text()
    assert "`.venv/bin/kvproxy`" in readme and "`source .venv/bin/activate`" in readme


def test_a_flag_abbreviated_is_an_error_not_another_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for argv in (["serve", "--slot", "3"], ["ls", "--cache", "/tmp"], ["doctor", "--up", "x"]):
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert done.value.code == 2
        assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err


def test_kvproxy_stats_help_says_it_asks_a_proxy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["stats", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "address of the kvproxy to ask" in shown and "port of the kvproxy to ask" in shown
    assert "listen on" not in shown


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("upstream", "127.0.0.1:8080", "must be a URL with its scheme, such as http://"),
        ("upstream", "ftp://x", "must be an http:// or https:// URL"),
        ("slots", "abc", "must be a whole number"),
        ("slots", "0", "must be at least 1"),
        ("port", "99999", "must be at most 65535"),
        ("ttl", "3x", "a duration such as 90s, 15m, 12h or 3d"),
        ("max_disk", "10XB", "must be a size such as 512MiB, 50GiB or 0"),
        ("write_through", "maybe", "must be true or false"),
        ("log_level", "loud", "must be one of 'debug', 'info', 'warning' or 'error'"),
    ],
)
def test_a_bad_value_is_said_in_kvproxys_words(field: str, value: str, says: str) -> None:
    with pytest.raises(SystemExit) as done:
        load_settings({field: value})
    message = str(done.value.code)
    flag = "--" + field.replace("_", "-")
    assert message.startswith(f"kvproxy: invalid setting: {flag} / KVPROXY_"), message
    assert says in message and f"(got {value!r})" in message, message
    assert "Input should" not in message and "relative URL" not in message


def test_the_swa_note_says_managed_mode_added_swa_full() -> None:
    swa = ModelInfo(Path("g.gguf"), "gemma3", n_swa=512, has_swa=True, model_class="swa")
    managed = swa_note(swa, managed=True)
    assert "started with --swa-full" in managed and "need" not in managed
    assert "only if llama-server runs with --swa-full" in swa_note(swa, managed=False)
    assert swa_note(ModelInfo(Path("l.gguf"), "llama", model_class="dense"), True) == ""


async def test_get_root_names_the_api_and_the_status_page(make: Maker) -> None:
    fake, proxy = await make()
    async with aiohttp.ClientSession() as s, s.get(proxy.url + "/") as resp:
        status, body = resp.status, await resp.json()
    assert status == 404 and "/v1" in body["error"]["message"]
    assert "/kvproxy/" in body["error"]["message"]
    assert all(path != "/" for _, path, _ in fake.requests)  # answered by kvproxy


def serve_sidecar(upstream: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvproxy.cli",
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
    ]


async def run_until_ready(
    command: list[str], cache: Path, port: int
) -> tuple[asyncio.subprocess.Process, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    proc = await asyncio.create_subprocess_exec(
        *command,
        "--cache-dir",
        str(cache),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stderr is not None
    out = ""
    async with asyncio.timeout(60):
        while "kvproxy ready" not in out:
            line = await proc.stderr.readline()
            if not line:
                break
            out += line.decode()
    return proc, out


async def stop_and_read(proc: asyncio.subprocess.Process, said: str) -> str:
    """SIGTERM a kvproxy that got ready; one that did not is on its way out on its own (its
    stderr ended), and a SIGTERM now would race its exit."""
    if proc.returncode is None and "kvproxy ready" in said:
        proc.send_signal(signal.SIGTERM)
    assert proc.stderr is not None
    rest = await asyncio.wait_for(proc.stderr.read(), 60)
    await proc.wait()
    return said + rest.decode()


async def test_a_sidecar_of_a_dead_server_says_so_before_ready_and_a_closing_line(
    tmp_path: Path,
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    proc, said = await run_until_ready(serve_sidecar(dead, port), tmp_path / "cache", port)
    out = await stop_and_read(proc, said)
    lines = [line for line in out.splitlines() if " kvproxy" in line or "kvproxy:" in line]
    warned = next(i for i, line in enumerate(lines) if f"{dead} does not answer" in line)
    ready = next(i for i, line in enumerate(lines) if "kvproxy ready" in line)
    assert warned < ready and f"{dead} (not answering yet)" in lines[ready], out
    assert proc.returncode == 0 and lines[-1].endswith("kvproxy stopped"), out


async def test_an_upstream_that_is_a_kvproxy_is_named_in_one_line(
    tmp_path: Path, make: Maker
) -> None:
    _, inner = await make()
    port = free_port()
    proc, said = await run_until_ready(serve_sidecar(inner.url, port), tmp_path / "c", port)
    out = await stop_and_read(proc, said)
    assert proc.returncode == 1, out
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith(f"kvproxy: --upstream {inner.url} is a kvproxy, not a llama-server")
    ), out


@pytest.mark.real
async def test_llama_servers_own_verbosity_quiets_what_managed_mode_relays(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    """docs/config.md's way to quiet the relayed log: `-- --log-verbosity 2` (llama-server's
    own flag; warnings and errors only). Counted on what ManagedServer relays and keeps."""
    from kvproxy.server.managed import ManagedServer, find_server_binary, server_command

    binary = find_server_binary(None)
    kept = []
    for extra in ([], ["--log-verbosity", "2"]):
        port = free_port()
        command = server_command(
            binary, tiny_models["dense"], port, tmp_path, 1, 256, None, ["-t", "1", *extra]
        )
        server = ManagedServer(command, port)
        await server.start(timeout=120)
        try:
            body = {"prompt": "Hello", "n_predict": 4}
            async with (
                aiohttp.ClientSession() as s,
                s.post(server.url + "/completion", json=body) as resp,
            ):
                assert resp.status == 200
        finally:
            await server.stop()
        kept.append(len(await server.recent_log(1000)))
    loud, quiet = kept
    print(f"\nrelayed lines: {loud} by default, {quiet} with --log-verbosity 2")
    assert loud >= 10 and quiet <= loud // 4, kept
