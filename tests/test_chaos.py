"""`kvproxy bench chaos`, short: a real llama-server (the tiny dense model, for speed) behind
kvproxy, 10 SIGKILLs of either, slow clients trickling requests all along, the cache disk full
for a while (a tmpfs: mounting it needs root, as CI runs), and the audit. What is asserted is
the audit's result, never a time: no kvproxy 500s, nothing stuck, every committed entry
valid, every conversation restored at the end answering as the server alone does, no
cross-tenant reads (nor headers telling another tenant's prompt from a fresh one), caching
again once the disk is freed."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from kvproxy_bench import chaos, chaos_records, chaos_report
from kvproxy_bench.arms import BenchEnv
from kvproxy_bench.chaos_plan import Fault, Kind, Outcome

pytestmark = pytest.mark.real


async def test_chaos_with_ten_faults_keeps_every_promise(
    tmp_path: Path, tiny_models: dict[str, Path]
) -> None:
    env = await asyncio.to_thread(BenchEnv.create, tmp_path / "work", str(tiny_models["dense"]))
    # The random-weight model's logits are nearly flat: llama-server alone answers a turn
    # differently when the conversation's tokens were decoded one by one (a resident slot) than
    # when they were prefilled in a batch (a fresh slot), measured 'q�`�`�q' vs 'q�`�`�`'.
    # With micro-batches of one token, prefill computes every token as decoding does, so the
    # KV is the same however a token got into the slot: a different answer can only be
    # kvproxy's.
    env.server_args += ["--no-warmup", "--ubatch-size", "1"]
    env.threads = 1  # shares a busy machine far better than threads that spin-wait
    opts = chaos_records.ChaosOptions(seed=16, requests=80, faults=10, n_facts=6)
    opts.slow_clients, opts.slow_interval, opts.latency_requests = 8, 0.5, 3
    opts.full_disk, opts.disk_mib, opts.full_for = True, 64, 10
    opts.timing_pairs = 4
    result = await chaos.run_chaos(env, opts)

    verdict = result.verdict()
    assert verdict.violations() == [], chaos_report.markdown(result)
    # Every check but the latency ratio, which is printed, not asserted (a shared machine).
    assert all(c.met for c in chaos_report.checks(result) if "latency" not in c.target)

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
    # The end: most conversations came back from disk and answered as the server alone did,
    # byte for byte (no tie excused).
    restored = [f for f in result.final if f.cache_state == "restored"]
    assert len(restored) >= len(result.final) // 2 > 0
    assert all(f.same for f in result.final)
    # The slow clients were there all along and other clients were measured with them.
    assert result.slow is not None and result.slow.opened >= 8
    assert result.slow_effect.held == 8 and all(result.slow_effect.with_slow.values())
    # The disk was full for a while (kvproxy said so) and caching came back after.
    disk = result.disk
    assert disk is not None and disk.filler_mib > 0 and disk.requests_while_full >= 10
    assert disk.saves_after > 0
    # The timing pairs ran, and nothing in kvproxy's headers told them apart.
    assert len(result.timing.pairs) == 4 and result.timing.differing() == 0
    # kvproxy's table says so too.
    assert "**Every promise held.**" in chaos_report.markdown(result)
