"""`kvproxy bench chaos`, short: a real llama-server (the tiny dense model, for speed) behind
kvproxy, 10 SIGKILLs of either, and the audit. What is asserted is the audit's result, never a
time: no kvproxy 500s, nothing stuck, every committed entry valid, every conversation restored
at the end answering as the server alone does, no cross-tenant reads."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvproxy.bench import chaos
from kvproxy.bench.arms import BenchEnv
from kvproxy.bench.chaos_plan import Fault, Kind, Outcome

pytestmark = pytest.mark.real


async def test_chaos_with_ten_faults_keeps_every_promise(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    env = await asyncio.to_thread(BenchEnv.create, tmp_path / "work", str(tiny_models["dense"]))
    # The random-weight model's logits are nearly flat, so an f16 KV cache rounded after a
    # different batch split (a restore plus the new turn vs. one prefill) can flip a greedy
    # token by itself; in f32 the two computations agree, and only kvproxy could differ.
    env.server_args += ["--no-warmup", "--cache-type-k", "f32", "--cache-type-v", "f32"]
    env.threads = 1  # shares a busy machine far better than threads that spin-wait
    result = await chaos.run_chaos(env, chaos.ChaosOptions(seed=16, requests=80, faults=10))

    verdict = result.verdict()
    assert verdict.violations() == [], chaos.markdown(result)
    assert all(c.met for c in chaos.checks(result))

    # Both kinds of fault happened, and with requests in flight.
    kinds = {f.fault for f in result.faults}
    assert kinds == {Fault.KILL_PROXY.value, Fault.KILL_SERVER.value}
    assert len(result.faults) == 10 and any(f.in_flight for f in result.faults)
    # The faults cost requests (so they really hit work), and the workload still got through
    # on every API.
    tally = result.tally
    assert tally.total(Outcome.OK) > 20 and tally.total() > tally.total(Outcome.OK)
    for kind in (Kind.CHAT, Kind.RESPONSES, Kind.METRICS, Kind.PROBE):
        assert tally.counts[(kind, Outcome.OK)] > 0, kind
    # What is on disk survived the kills: committed entries, all valid, nothing half-written.
    assert result.audit.committed > 0 and result.audit.valid == result.audit.committed
    assert not [n for n in result.audit.orphaned if ".tmp" in n]
    # The end: most conversations came back from disk and answered as the server alone did
    # (or parted from it only where the server's own top two tokens were tied).
    restored = [f for f in result.final if f.cache_state == "restored"]
    assert len(restored) >= len(result.final) // 2 > 0
    assert all(f.same or f.tie is not None for f in result.final)
    assert sum(f.same for f in result.final) >= len(result.final) - 2
    # kvproxy's table says so too.
    assert "**Every promise held.**" in chaos.markdown(result)
