"""`kvproxy bench shared` and `fim`: llama.vscode's request bodies (fim.py), the prefill table
on plain data, and the scenarios' mechanics against the fake llama-server — the server alone
and kvproxy in front of it, each restarted as the real arms are."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvproxy_bench import fim_replay, shared
from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, Arm
from kvproxy_bench.client import Client
from kvproxy_bench.fim import FIM_TEMPLATE, FimConfig, editing_session
from kvproxy_bench.prefill import Request, summary

from .conftest import RunningProxy, start_proxy
from .fakeserver import FakeLlamaServer

INFILL_FIELDS = [
    *("id_slot", "input_prefix", "input_suffix", "input_extra", "prompt", "n_predict"),
    *("n_cmpl", "top_k", "top_p", "stream", "samplers", "cache_prompt"),
]


def test_the_session_is_llama_vscodes_requests_and_the_same_for_a_seed() -> None:
    requests = editing_session(seed=7, edits=12)
    assert [r.body for r in requests] == [r.body for r in editing_session(seed=7, edits=12)]
    infills = [r for r in requests if r.kind == "infill"]
    rings = [r for r in requests if r.kind == "ring"]
    assert len(infills) == 36 and rings  # 3 keystrokes a line; idle pauses update the ring
    for r in infills:
        assert list(r.body)[: len(INFILL_FIELDS)] == INFILL_FIELDS
        assert r.body["id_slot"] == 0 and r.body["n_predict"] == 128
        assert r.body["samplers"] == ["top_k", "top_p", "infill"]
        assert r.body["t_max_prompt_ms"] == 500 and r.body["t_max_predict_ms"] == 2500
        assert r.body["input_prefix"].endswith("\n") and r.body["input_suffix"].endswith("\n")
    for r in rings:
        assert r.openai is None
        assert (r.body["n_predict"], r.body["t_max_predict_ms"], r.body["samplers"]) == (0, 1, [])
        assert r.body["input_prefix"] == r.body["input_suffix"] == r.body["prompt"] == ""
    # Each ring update adds the chunk it sends to the ring the next completions carry.
    sizes = [len(r.body["input_extra"]) for r in requests]
    assert sizes == sorted(sizes) and sizes[-1] >= len(rings)
    chunk = rings[-1].body["input_extra"][-1]
    assert set(chunk) == {"text", "time", "filename"} and chunk["text"].endswith("\n")


def test_openai_mode_fills_the_template_with_cut_prefix_and_suffix() -> None:
    cfg = FimConfig(n_prefix=256, n_suffix=64)
    last = [r for r in editing_session(edits=12, cfg=cfg) if r.openai is not None][-1]
    assert last.openai is not None
    body, args = last.body, last.openai
    filled = (
        FIM_TEMPLATE.replace("{inputPrefix}", body["input_prefix"][-256:])
        .replace("{prompt}", body["prompt"])
        .replace("{inputSuffix}", body["input_suffix"][:64])
    )
    assert args["prompt"].startswith("Context:\n\n") and args["prompt"].endswith(filled)
    assert (args["max_tokens"], args["temperature"], args["top_p"]) == (128, 0.1, 0.99)


def test_the_summary_judges_against_the_ideal_and_the_server_alone() -> None:
    rows = [
        Request(DIRECT_RAM_CACHE, "p", "a", 200, 0, 1000, 100),
        Request(DIRECT_RAM_CACHE, "p", "b", 200, 500, 500, 100),
        Request(KVPROXY, "p", "a", 200, 900, 100, 100),
        Request(KVPROXY, "p", "b", 200, 900, 100, 100),
        Request(KVPROXY, "p", "c", 500, 0, 0, 0),
    ]
    table = {(r[0], r[1]): r for r in summary(rows, [DIRECT_RAM_CACHE, KVPROXY], ["p"])}
    direct, proxied = table[DIRECT_RAM_CACHE, "p"], table[KVPROXY, "p"]
    assert direct[2:8] == [2, 2, 2000, 1500, 500, 200] and direct[8] == "27.8%"
    assert proxied[2:8] == [3, 2, 2000, 200, 1800, 200] and proxied[8] == "100.0%"
    assert proxied[9] == "0.13×"  # 200 prefilled against the server alone's 1,500


class FakeDirect(Arm):
    """The fake llama-server alone: a restart loses every slot."""

    def __init__(self, where: Path) -> None:
        self.name, self.cache_dir, self.url = DIRECT_RAM_CACHE, where, ""
        self.fake: FakeLlamaServer | None = None

    async def start(self) -> None:
        self.fake = FakeLlamaServer(n_slots=2, slot_save_path=self.cache_dir)
        self.url = await self.fake.start()

    async def stop(self) -> None:
        if self.fake is not None:
            await self.fake.stop()


class FakeProxied(FakeDirect):
    """kvproxy in front of the fake: a restart stops both, the cache dir stays."""

    def __init__(self, where: Path) -> None:
        super().__init__(where)
        self.name = KVPROXY
        self.proxy: RunningProxy | None = None

    async def start(self) -> None:
        await super().start()
        assert self.fake is not None
        self.proxy = await start_proxy(self.fake.url, self.cache_dir, **self.options())
        self.url = self.proxy.url

    def options(self) -> dict[str, Any]:
        """`kvproxy serve`'s settings for this arm."""
        return {}

    async def stop(self) -> None:
        if self.proxy is not None:
            await self.proxy.stop()
        await super().stop()


async def test_shared_sessions_run_through_both_arms_and_a_restart(tmp_path: Path) -> None:
    opts = shared.SharedOptions(sessions=3, turns=3, subagents=2, prompt_tokens=400)
    result = shared.SharedResult(options=asdict(opts))
    client = Client()
    try:
        for k, make in enumerate((FakeDirect, FakeProxied)):
            where = tmp_path / str(k)
            where.mkdir()
            async with make(where) as running:
                await shared._sessions(shared._Run(client, running, opts, result))
    finally:
        await client.close()
    text = shared.markdown(result)
    for name in (DIRECT_RAM_CACHE, KVPROXY):
        mine = [r for r in result.requests if r.arm == name]
        # 3 × 3 main turns, 2 windows of a 1-turn and a 2-turn sub-agent, 3 after the restart
        assert len(mine) == 9 + 2 * 3 + 3
        assert all(r.status == 200 for r in mine), [r.error for r in mine]
        assert sum(r.ideal == r.prompt for r in mine) == 1  # the first: nothing cached yet
        assert all(0 < r.ideal <= r.prompt for r in mine)
        after = [r for r in mine if r.phase == "after restart"]
        assert len(after) == 3 and all(r.what.endswith("turn 4") for r in after)
    direct = [r for r in result.requests if r.arm == DIRECT_RAM_CACHE]
    assert next(r.cached for r in direct if r.phase == "after restart") == 0  # RAM lost
    proxied = [r for r in result.requests if r.arm == KVPROXY]
    # The promise: no more prefill than the server alone, ≥ 99% of ideal after the
    # evictions (5 sessions, 2 slots) and the restart.
    assert sum(r.prefilled for r in proxied) <= sum(r.prefilled for r in direct)
    back = [r for r in proxied if r.phase == "after restart"]
    assert sum(r.cached for r in back) >= 0.99 * sum(r.reusable for r in back)
    assert "after restart" in text and "prefilled vs server alone" in text


class FakeWritingThrough(FakeProxied):
    def __init__(self, where: Path) -> None:
        super().__init__(where)
        self.name = fim_replay.KVPROXY_WRITE_THROUGH

    def options(self) -> dict[str, Any]:
        return {"write_through": True}


async def test_fim_replays_through_every_arm_and_a_restart(tmp_path: Path) -> None:
    """The fake has no /infill (404, recorded as such); the OpenAI SDK pass and the restart
    run in full, the returning completions judged against an ideal of nothing new: with
    --write-through each comes back from its own state."""
    opts = fim_replay.FimOptions(edits=3, n_predict=4, returning=2)
    result = fim_replay.FimResult(options=asdict(opts))
    client = Client()
    try:
        for k, make in enumerate((FakeDirect, FakeProxied, FakeWritingThrough)):
            where = tmp_path / str(k)
            where.mkdir()
            async with make(where) as running:
                await fim_replay._replay(client, running, opts, result)
    finally:
        await client.close()
    for name in (DIRECT_RAM_CACHE, KVPROXY, fim_replay.KVPROXY_WRITE_THROUGH):
        mine = [r for r in result.requests if r.arm == name]
        assert {r.status for r in mine if r.phase == "infill"} == {404}
        sdk = [r for r in mine if r.phase == "openai"]
        assert len(sdk) == 9 and all(r.status == 200 and r.prompt > 0 for r in sdk)
        back = [r for r in mine if r.phase == "after restart"]
        assert len(back) == 2 and all(r.ideal == 0 for r in back)
    written = [r for r in result.requests if r.arm == fim_replay.KVPROXY_WRITE_THROUGH]
    assert [r.prefilled for r in written if r.phase == "after restart"] == [1, 1]
    # Its saves after each reply cost the next completion no reuse: it waits for its slot.
    alone = [r for r in result.requests if r.arm == DIRECT_RAM_CACHE and r.phase == "openai"]
    assert [r.prefilled for r in written if r.phase == "openai"] == [r.prefilled for r in alone]
    assert "after restart" in fim_replay.markdown(result)


class _CharTokens(fim_replay.Tokens):
    """One token a character (BOS 0): no server needed."""

    async def of(self, text: str, special: bool = False) -> list[int]:
        return ([0] if special else []) + [ord(c) for c in text]


async def test_the_infill_ideal_cuts_the_prompt_as_the_server_does() -> None:
    """format_prompt_infill keeps the end of the prefix within 3/4 of a batch, the start of
    the suffix within the rest, and the end of the extra chunks within n_ctx - n_batch + 2:
    an ideal without those cuts counts tokens the server never evaluates."""
    tokens = _CharTokens(client=None, base="", n_ctx=4096)  # type: ignore[arg-type]
    body = {
        "input_prefix": "p" * 3000,
        "prompt": "",
        "input_suffix": "s" * 1000,
        "input_extra": [{"filename": "a.py", "text": "x" * 5000}],
    }
    got = await tokens.infill(body)
    n_batch = fim_replay.N_BATCH
    assert got.count(ord("p")) == 3 * (n_batch // 4)
    assert got.count(ord("s")) == n_batch // 4 - 2
    pre = got.index(fim_replay.FIM_PRE)
    assert pre == (4096 - n_batch + 2) + 1, "the extra chunks' end, then BOS"
    assert got[-1] == fim_replay.FIM_MID
