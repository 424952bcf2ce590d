"""A state is restored only into a server that would compute it, against a real llama-server.

Every case compares a turn served through kvproxy with what the server computes for the same
request from scratch (`cache_prompt: false`): the first reply token's distribution (its five
most likely tokens and their log-probabilities, within the probe's tolerance; a grammar keeps
the reply printable so the server reports them). A turn kvproxy restored from a state some
other weights, adapter scales or settings computed would not match; a miss does.

The models are tiny random-weight GGUFs (tests/ggufmodels.py): the dense llama, a variant of
it of the same size (other weights), and a LoRA adapter for it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvproxy.handlers.prepare import SNAPSHOT_TRUST
from kvproxy.server import localproc
from kvproxy.server.managed import find_server_binary, free_port, server_flags
from kvproxy.server.probe import Behaviour

from .conftest import RealServer, committed, run_server_command, start_proxy, start_real_server
from .ggufmodels import write_dense_llama, write_lora

pytestmark = pytest.mark.real

GRAMMAR = "root ::= [a-z ]+"
ADAPTER_OFF = {"lora": [{"id": 0, "scale": 0.0}]}
SLOTS, CTX = 2, 2048


@dataclass
class Answer:
    top: Behaviour
    decision: str
    reply: dict[str, Any]


def conversation(n: int) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": f"You answer question {n} of the quiz. " + "word " * 120},
        {"role": "user", "content": f"What is the answer to question {n}?"},
    ]


def then(messages: list[dict[str, Any]], answer: Answer) -> list[dict[str, Any]]:
    reply = answer.reply["choices"][0]["message"]["content"]
    return [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And the next one?"},
    ]


async def ask(url: str, messages: list[dict[str, Any]], **extra: Any) -> Answer:
    body = {
        "messages": messages,
        "max_tokens": 3,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 5,
        "grammar": GRAMMAR,
        **extra,
    }
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        reply = await r.json()
        decision = r.headers.get("X-KVProxy-Cache", "")
    first = reply["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    top = Behaviour(tuple((t["id"], t["logprob"]) for t in first))
    return Answer(top, decision, reply)


async def alone(server_url: str, messages: list[dict[str, Any]], **extra: Any) -> Behaviour:
    """What the server computes for the request from scratch."""
    return (await ask(server_url, messages, cache_prompt=False, **extra)).top


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fingerprint-models")
    return {
        "base": write_dense_llama(root / "base.gguf"),
        "variant": write_dense_llama(root / "variant.gguf", seed=7),
        "lora": write_lora(root / "adapter.gguf"),
    }


@pytest.fixture
def unseen_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """kvproxy cannot see the server's process (a server on another host, in a container):
    only what the server reports, and the behavioural probe, tell its settings."""
    monkeypatch.setattr(localproc, "find", lambda url: None)


# Every server a test starts, stopped when it ends however it ends (a failed assertion too).
STARTED: list[RealServer | Started] = []


@pytest.fixture(autouse=True)
def _stop_servers() -> Iterator[None]:
    yield
    while STARTED:
        STARTED.pop().stop()


def serve(cache: Path, model: Path, *flags: str, port: int | None = None) -> RealServer:
    server = start_real_server(cache, model, SLOTS, CTX, ("--cache-ram", "0", *flags), port)
    STARTED.append(server)
    return server


# --- 1. a request's own adapter scales


async def test_a_request_with_other_adapter_scales_never_gets_the_others_state(
    models: dict[str, Path], cache_dir: Path
) -> None:
    """Server started with an adapter (`--lora`, scale 1 for a request naming none); some
    requests turn it off: `"lora": [{"id": 0, "scale": 0}]`."""
    server = serve(cache_dir, models["base"], "--lora", str(models["lora"]))
    proxy = await start_proxy(server.url, cache_dir)
    try:
        # The next turn on the same slot, with the adapter: not the slot's state.
        first = await ask(proxy.url, conversation(1), **ADAPTER_OFF)
        adapted_next = then(conversation(1), first)
        resident_adapted = await ask(proxy.url, adapted_next)
        # A conversation without the adapter, saved and evicted by two others.
        second = await ask(proxy.url, conversation(2), **ADAPTER_OFF)
        for n in (3, 4):
            await ask(proxy.url, conversation(n))
        second_next = then(conversation(2), second)
        restored_adapted = await ask(proxy.url, second_next)
        # Without the adapter, its own state comes back from disk.
        restored_plain = await ask(proxy.url, second_next, **ADAPTER_OFF)
    finally:
        await proxy.stop()
    try:
        assert resident_adapted.decision == "miss"
        assert restored_adapted.decision == "miss"
        assert restored_plain.decision == "restored"
        assert resident_adapted.top.matches(await alone(server.url, adapted_next))
        assert restored_adapted.top.matches(await alone(server.url, second_next))
        plain = await alone(server.url, second_next, **ADAPTER_OFF)
        assert restored_plain.top.matches(plain)
        assert not plain.matches(restored_adapted.top), "the adapter changes the answer"
    finally:
        server.stop()


# --- 2. router presets of one GGUF file


async def test_router_presets_of_one_file_never_share_their_states(
    models: dict[str, Path], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--models-preset`: "plain" is the file as it is, "tuned" the same file with an adapter,
    "rebased" with another rope base. A chat UI's model picker moves a conversation between
    them: each continues from scratch, as the router alone would serve it."""
    monkeypatch.setenv("LLAMA_CACHE", str(cache_dir.parent / "hf-cache"))  # no other models
    preset = cache_dir.parent / "presets.ini"
    base, lora = models["base"], models["lora"]
    preset.write_text(
        f"[plain]\nmodel = {base}\n\n"
        f"[tuned]\nmodel = {base}\nlora = {lora}\n\n"
        f"[rebased]\nmodel = {base}\nrope-freq-base = 20000\n"
    )
    port = free_port()
    command = [str(find_server_binary(None)), "--models-preset", str(preset)]
    command += [*server_flags(port, cache_dir, SLOTS, CTX, None), "--cache-ram", "0"]
    log_path = cache_dir.parent / f"llama-server-{port}.log"
    managed = run_server_command(command, port, log_path)
    router = RealServer(managed.url, cache_dir, base, managed, log_path)
    STARTED.append(router)
    proxy = await start_proxy(router.url, cache_dir, write_through=True)
    try:
        first = await ask(proxy.url, conversation(1), model="plain")
        moved = then(conversation(1), first)
        answers = {name: await ask(proxy.url, moved, model=name) for name in ("tuned", "rebased")}
        back = await ask(proxy.url, moved, model="plain")
    finally:
        await proxy.stop()
    try:
        assert back.decision in ("resident", "restored")  # its own state still serves it
        for name, answer in answers.items():
            assert answer.decision == "miss", name
            assert answer.top.matches(await alone(router.url, moved, model=name)), name
    finally:
        router.stop()


# --- 3. a restart with other settings


CHANGES: dict[str, tuple[str, ...]] = {
    "adapter added": ("--lora", "{lora}"),
    "rope base": ("--rope-freq-base", "20000"),
    "rope scaling": ("--rope-scaling", "linear", "--rope-scale", "2"),
    "metadata override": ("--override-kv", "llama.rope.freq_base=float:20000"),
}


@pytest.mark.parametrize("seen", ["command line", "probe only"])
@pytest.mark.parametrize("change", list(CHANGES))
async def test_a_restart_with_other_settings_restores_no_old_state(
    models: dict[str, Path], cache_dir: Path, change: str, seen: str, request: pytest.FixtureRequest
) -> None:
    """kvproxy and the server restart, the server with another setting that changes the KV it
    computes. Read from its command line, or (a server kvproxy cannot see) from its answers
    and the behavioural probe: the old conversation misses, and new ones are cached."""
    if seen == "probe only":
        request.getfixturevalue("unseen_flags")
    flags = tuple(f.format(lora=models["lora"]) for f in CHANGES[change])
    server = serve(cache_dir, models["base"])
    proxy = await start_proxy(server.url, cache_dir, write_through=True)
    try:
        first = await ask(proxy.url, conversation(1))
    finally:
        await proxy.stop()
        server.stop()
    assert len(committed(cache_dir)) == 1
    server = serve(cache_dir, models["base"], *flags)
    proxy = await start_proxy(server.url, cache_dir, write_through=True)
    try:
        next_turn = then(conversation(1), first)
        continued = await ask(proxy.url, next_turn)
        fresh = await ask(proxy.url, conversation(2))
        for n in (3, 4):  # both slots taken: conversation 2 comes back from disk
            await ask(proxy.url, conversation(n))
        fresh_next = await ask(proxy.url, then(conversation(2), fresh))
    finally:
        await proxy.stop()
    try:
        assert continued.decision == "miss"
        assert continued.top.matches(await alone(server.url, next_turn))
        assert fresh_next.decision in ("resident", "restored")
    finally:
        server.stop()


# --- 4. the model file replaced while the server runs


@pytest.mark.parametrize("same_time", [True, False], ids=["same size and time", "newer"])
async def test_a_model_replaced_under_a_running_server_files_nothing_under_the_new_one(
    models: dict[str, Path], cache_dir: Path, tmp_path: Path, same_time: bool
) -> None:
    """An update or re-download replaces the model file while the server runs (it still
    computes with the weights it loaded), and the server is restarted later, on its own:
    no conversation saved before or meanwhile is restored into the new weights."""
    model = tmp_path / "model.gguf"
    shutil.copy(models["base"], model)
    server = serve(cache_dir, model)
    proxy = await start_proxy(server.url, cache_dir, write_through=True)
    backend = proxy.cache.lanes[0].backend
    try:
        first = await ask(proxy.url, conversation(1))
        was = model.stat()
        shutil.copy(models["variant"], tmp_path / "download.part")
        os.replace(tmp_path / "download.part", model)
        if same_time:
            os.utime(model, ns=(was.st_atime_ns, was.st_mtime_ns))
        await backend.discover()  # kvproxy's look at the server, every 15 s
        second = await ask(proxy.url, conversation(2))  # the old weights answer
        server.stop()
        server = serve(cache_dir, model, port=int(server.url.rsplit(":", 1)[1]))
        await backend.discover()  # the next look finds the server started again
        turns = [then(conversation(1), first), then(conversation(2), second)]
        continued = [await ask(proxy.url, turn) for turn in turns]
        fresh = await ask(proxy.url, conversation(3))
        for n in (4, 5):
            await ask(proxy.url, conversation(n))
        fresh_next = await ask(proxy.url, then(conversation(3), fresh))
    finally:
        await proxy.stop()
    try:
        for turn, answer in zip(turns, continued, strict=True):
            assert answer.decision == "miss"
            assert answer.top.matches(await alone(server.url, turn))
        assert fresh_next.decision in ("resident", "restored"), "the new weights' states are cached"
    finally:
        server.stop()


async def test_a_server_restarted_unseen_with_other_weights_restores_no_old_state(
    models: dict[str, Path], cache_dir: Path, tmp_path: Path, unseen_flags: None
) -> None:
    """A server kvproxy cannot see (another host) restarted with other weights at the same
    path between two of kvproxy's looks: its slots show it (an older task than kvproxy's
    last one), and nothing is restored until its fingerprint is read again."""
    model = tmp_path / "model.gguf"
    shutil.copy(models["base"], model)
    server = serve(cache_dir, model)
    proxy = await start_proxy(server.url, cache_dir, write_through=True)
    try:
        first = await ask(proxy.url, conversation(1))
        for n in (5, 6):  # both slots taken: conversation 1 is on disk only
            await ask(proxy.url, conversation(n))
        was = model.stat()
        shutil.copy(models["variant"], model)
        os.utime(model, ns=(was.st_atime_ns, was.st_mtime_ns))
        server.stop()
        server = serve(cache_dir, model, port=int(server.url.rsplit(":", 1)[1]))
        # A real model takes longer to load than kvproxy trusts a slot it has not looked at.
        await asyncio.sleep(SNAPSHOT_TRUST)
        next_turn = then(conversation(1), first)
        continued = await ask(proxy.url, next_turn)
        backend = proxy.cache.lanes[0].backend
        for _ in range(600):  # kvproxy reads the server's fingerprint again (at once)
            if backend.doubt is None:
                break
            await asyncio.sleep(0.05)
        fresh = await ask(proxy.url, conversation(2))
        for n in (3, 4):
            await ask(proxy.url, conversation(n))
        fresh_next = await ask(proxy.url, then(conversation(2), fresh))
    finally:
        await proxy.stop()
    try:
        assert continued.decision == "miss"
        assert continued.top.matches(await alone(server.url, next_turn))
        assert fresh_next.decision in ("resident", "restored")
    finally:
        server.stop()


# --- 5. a relative model path


async def test_a_relative_model_path_is_read_in_the_servers_directory(
    models: dict[str, Path], cache_dir: Path, tmp_path: Path
) -> None:
    """`llama-server -m model.gguf` started in its own directory: kvproxy, started elsewhere,
    reads that file's content. Replaced by another of the same size and time between two
    runs, the old conversation misses."""
    where = tmp_path / "models"
    where.mkdir()
    shutil.copy(models["base"], where / "model.gguf")
    was = (where / "model.gguf").stat()
    server = serve_in(where, cache_dir)
    proxy = await start_proxy(server.url, cache_dir, write_through=True)
    try:
        first = await ask(proxy.url, conversation(1))
    finally:
        await proxy.stop()
        server.stop()
    shutil.copy(models["variant"], where / "model.gguf")
    os.utime(where / "model.gguf", ns=(was.st_atime_ns, was.st_mtime_ns))
    server = serve_in(where, cache_dir)
    proxy = await start_proxy(server.url, cache_dir, write_through=True)
    try:
        next_turn = then(conversation(1), first)
        continued = await ask(proxy.url, next_turn)
    finally:
        await proxy.stop()
    try:
        assert continued.decision == "miss"
        assert continued.top.matches(await alone(server.url, next_turn))
    finally:
        server.stop()


@dataclass
class Started:
    url: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


def serve_in(directory: Path, cache: Path) -> Started:
    """llama-server started in `directory` with `-m model.gguf`."""
    port = free_port()
    command = [str(find_server_binary(None)), "-m", "model.gguf"]
    command += [*server_flags(port, cache, SLOTS, CTX, None), "--cache-ram", "0"]
    log = open(cache.parent / f"llama-server-{port}.log", "ab")
    proc = subprocess.Popen(command, cwd=directory, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    started = Started(url, proc)
                    STARTED.append(started)
                    return started
        except OSError:
            assert proc.poll() is None, "llama-server ended"
        time.sleep(0.2)
    proc.kill()
    raise AssertionError("llama-server did not come up")


# --- 6. a state the server refuses for its layout


async def test_switching_layouts_back_and_forth_keeps_both_layouts_states(
    models: dict[str, Path], cache_dir: Path, unseen_flags: None
) -> None:
    """Flash attention lays the V cache out another way: a server with it off refuses (400) a
    state saved with it on. Where kvproxy cannot see the flag (nor the probe tell, as the
    numbers barely move), it tries the restore; the refused state is kept for the layout that
    saved it, and restored once the server runs that way again."""
    states: list[Answer] = []
    for fa in ("on", "off", "on"):
        server = serve(cache_dir, models["base"], "--flash-attn", fa)
        proxy = await start_proxy(server.url, cache_dir, write_through=True)
        try:
            if not states:
                states.append(await ask(proxy.url, conversation(1)))
            else:
                states.append(await ask(proxy.url, then(conversation(1), states[0])))
        finally:
            await proxy.stop()
            server.stop()
        if fa == "off":
            # The refused state and the one this layout saved meanwhile are both on disk.
            assert len(committed(cache_dir)) == 2
    assert [a.decision for a in states] == ["miss", "miss", "restored"]


# --- 7. a chat template change


async def test_a_chat_template_change_makes_old_states_misses(
    models: dict[str, Path], cache_dir: Path, unseen_flags: None
) -> None:
    """The server restarted with another chat template (`--chat-template-file`): its prompts
    render otherwise, so an old state would be restored for nothing. GET /props shows the
    template: old conversations miss, new ones are cached."""
    template = cache_dir.parent / "template.jinja"
    template.write_text(
        "{%- for m in messages -%}{{- '<|im_start|>' + m['role'] + ': ' + m['content'] + "
        "'<|im_end|>' -}}{%- endfor -%}{%- if add_generation_prompt -%}"
        "{{- '<|im_start|>assistant: ' -}}{%- endif -%}"
    )
    server = serve(cache_dir, models["base"])
    proxy = await start_proxy(server.url, cache_dir, write_through=True)
    try:
        first = await ask(proxy.url, conversation(1))
    finally:
        await proxy.stop()
        server.stop()
    server = serve(cache_dir, models["base"], "--chat-template-file", str(template))
    proxy = await start_proxy(server.url, cache_dir, write_through=True)
    try:
        continued = await ask(proxy.url, then(conversation(1), first))
        fresh = await ask(proxy.url, conversation(2))
        for n in (3, 4):
            await ask(proxy.url, conversation(n))
        fresh_next = await ask(proxy.url, then(conversation(2), fresh))
    finally:
        await proxy.stop()
        server.stop()
    assert continued.decision == "miss"
    assert fresh_next.decision in ("resident", "restored")
