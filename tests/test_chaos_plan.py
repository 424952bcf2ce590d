"""`kvproxy bench chaos`'s rules on plain data: the plan, how a request's ending is read, what
counts as a cross-tenant read, the verdict, the cache-dir audit and the wire bodies."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from kvproxy_bench import chaos, chaos_records
from kvproxy_bench.chaos_audit import audit
from kvproxy_bench.chaos_plan import (
    Fault,
    Kind,
    Outcome,
    Verdict,
    Wire,
    classify,
    cross_tenant,
    fault_due,
    fault_plan,
    parts_at_a_tie,
)
from kvproxy_bench.chaos_slow import SlowEffect
from kvproxy_bench.chaos_tenants import TimingPair, TimingProbes, renumbered
from kvproxy_bench.chaos_wire import Stream, answer_of, route_body

from kvproxy.store.entry import Entry
from kvproxy.store.files import STATE_MAGIC
from kvproxy.store.store import Store


def test_the_fault_plan_is_seeded_and_mixes_both_kinds() -> None:
    a = fault_plan(random.Random("s"), 10)
    assert a == fault_plan(random.Random("s"), 10)
    assert a.count(Fault.KILL_PROXY) == 5 and a.count(Fault.KILL_SERVER) == 5
    # Spread through the run: none before the first requests end, none after the last.
    dues = [fault_due(i, 10, 60) for i in range(10)]
    assert dues == sorted(dues) and dues[0] > 0 and dues[-1] < 60


def test_endings_are_classified_as_the_client_saw_them() -> None:
    assert classify(200) is Outcome.OK
    assert classify(None, timed_out=True) is Outcome.STUCK
    assert classify(None, refused=True) is Outcome.REFUSED
    assert classify(None) is Outcome.CUT_OFF
    assert classify(200, hung_up=True) is Outcome.HUNG_UP
    assert classify(200, error_event=True) is Outcome.STREAM_ERROR
    assert classify(200, complete=False) is Outcome.CUT_OFF
    assert classify(500, proxy_error=True) is Outcome.KVPROXY_500
    assert classify(500) is Outcome.SERVER_500
    assert classify(502) is Outcome.BAD_GATEWAY
    assert classify(400) is Outcome.OTHER


def test_a_probe_reads_across_tenants_when_it_reuses_more_than_everyone_shares() -> None:
    assert not cross_tenant("miss", 12, allowed=12)
    assert cross_tenant("miss", 13, allowed=12)
    assert cross_tenant("restored", 0, allowed=12)


def test_answers_that_part_at_the_servers_own_tie_are_told_apart() -> None:
    # The server alone answered "abX", kvproxy "abY": at "X" its top two were 0.001 apart.
    tokens: list[tuple[bytes, float, float | None]]
    tokens = [(b"a", -1.0, -3.0), (b"b", -1.0, -2.0), (b"X", -4.5, -4.501)]
    assert parts_at_a_tie(tokens, "abY", "abX") == pytest.approx(0.001)
    # Clearly decided where they part: a real difference, whatever ties come after it.
    tokens = [(b"a", -1.0, -3.0), (b"X", -1.0, -2.0), (b"c", -4.5, -4.501)]
    assert parts_at_a_tie(tokens, "aYc", "aXc") is None
    # A tie both resolved alike, long before they part, is not the reason.
    tokens = [(b"a", -4.5, -4.501), *[(b"b", -1.0, -3.0)] * 4, (b"X", -1.0, -2.0)]
    assert parts_at_a_tie(tokens, "abbbbY", "abbbbX") is None


def test_the_verdict_fails_on_any_broken_promise_and_on_checks_that_never_ran() -> None:
    good = Verdict(0, 0, 0, 0, 0, 10, 10, restored_checked=3, probes=4)
    assert good.violations() == []
    assert Verdict(1, 0, 0, 0, 0, 10, 10, 3, 4).violations() == ["1 kvproxy 500s"]
    assert Verdict(0, 2, 0, 0, 0, 10, 10, 3, 4).violations() == ["2 stuck requests"]
    assert Verdict(0, 0, 0, 0, 1, 10, 10, 3, 4).violations() == ["1 cross-tenant reads"]
    assert Verdict(0, 0, 0, 0, 0, 9, 10, 3, 4).violations() == ["only 9 of 10 faults injected"]
    assert len(Verdict(0, 0, 0, 0, 0, 10, 10, 0, 0).violations()) == 2


def _commit(root: Path, key: str, state: bytes) -> None:
    """As a save commits: the server's file under a temp name, then the store's commit."""
    store = Store(root, 0, 0)
    temp = store.temp_name(key)
    (root / temp).write_bytes(state)
    assert store.commit(Entry(key, "ns", 3, 0, 1, 0.0, 0.0, chain=[key]), temp) is not None
    store.close()


def test_the_audit_finds_damaged_entries_and_orphans(tmp_path: Path) -> None:
    state = STATE_MAGIC.to_bytes(4, "little") + bytes(60)
    good, damaged, short = "a" * 32, "b" * 32, "c" * 32
    for key in (good, damaged, short):
        _commit(tmp_path, key, state)
    (tmp_path / f"{damaged}.kv").write_bytes(state[:-1] + b"\x01")  # same size, other bytes
    (tmp_path / f"{short}.kv").write_bytes(state[:-8])
    (tmp_path / f"{'d' * 32}.kv").write_bytes(state)  # never committed
    (tmp_path / f"{good}.1234abcd.tmp").write_bytes(b"x")  # a save cut short

    found = audit(tmp_path)
    assert (found.committed, found.valid) == (3, 1)
    assert sorted(k for k, _ in found.invalid) == [damaged, short]
    assert found.orphaned == [f"{good}.1234abcd.tmp", f"{'d' * 32}.kv"]


def test_one_conversation_is_written_out_for_each_api() -> None:
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "U2"},
    ]
    path, body = route_body(Wire.CHAT, messages, 8, stream=True)
    assert path == "/v1/chat/completions" and body["messages"] == messages and body["stream"]
    path, body = route_body(Wire.MESSAGES, messages, 8)
    assert path == "/v1/messages" and body["system"] == "S" and body["messages"] == messages[1:]
    path, body = route_body(Wire.RESPONSES, messages, 8)
    assert path == "/v1/responses" and body["instructions"] == "S"
    assert body["input"][1] == {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "A1"}],
    }
    assert body["temperature"] == 0 and "stream" not in body


def test_answers_are_read_from_every_api() -> None:
    assert answer_of(Wire.CHAT, {"choices": [{"message": {"content": "hi"}}]}) == "hi"
    assert answer_of(Wire.MESSAGES, {"content": [{"type": "text", "text": "hi"}]}) == "hi"
    out = {"output": [{"type": "message", "content": [{"type": "output_text", "text": "hi"}]}]}
    assert answer_of(Wire.RESPONSES, out) == "hi"
    assert answer_of(None, {"content": "hi"}) == "hi"
    assert answer_of(Wire.CHAT, {"error": {}}) is None

    chat = Stream()
    for line in (
        b'data: {"choices":[{"delta":{"content":"h"}}]}',
        b'data: {"choices":[{"delta":{"content":"i"}}],"timings":{"cache_n":5}}',
        b"data: [DONE]",
    ):
        chat.feed(Wire.CHAT, line)
    assert (chat.text, chat.done, chat.error, chat.timings) == ("hi", True, False, {"cache_n": 5})
    broken = Stream()
    broken.feed(Wire.CHAT, b'data: {"error":{"message":"broke off"}}')
    assert broken.error and not broken.done
    messages = Stream()
    messages.feed(Wire.MESSAGES, b'data: {"type":"content_block_delta","delta":{"text":"hi"}}')
    messages.feed(Wire.MESSAGES, b'data: {"type":"message_stop"}')
    assert (messages.text, messages.done) == ("hi", True)


def _result(*broken: Outcome) -> chaos_records.ChaosResult:
    """A run's result as chaos.py builds it: 10 faults, a restored conversation answering as
    the server alone, a probe that read nothing; `broken` adds requests that ended so."""
    result = chaos_records.ChaosResult(options={"faults": 10})
    result.faults = [chaos_records.FaultRecord(Fault.KILL_PROXY.value, 1.0, 1.0, 2)] * 10
    result.final = [chaos_records.FinalRecord(1000, "chat", "restored", 300, "same", "same")]
    result.probes = [chaos_records.ProbeRecord(1000, "miss", 12, 20, False)]
    result.tally.add(Kind.CHAT, Outcome.OK)
    for outcome in broken:
        result.tally.add(Kind.CHAT, outcome)
    return result


@pytest.mark.parametrize(("broken", "code"), [((), 0), ((Outcome.KVPROXY_500,), 1)])
def test_the_command_fails_when_a_promise_breaks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, broken: tuple[Outcome, ...], code: int
) -> None:
    from kvproxy_bench import arms, command

    from kvproxy import cli

    async def run_chaos(env: object, opts: chaos_records.ChaosOptions) -> chaos_records.ChaosResult:
        assert (opts.seed, opts.faults) == (7, 10)
        return _result(*broken)

    monkeypatch.setattr(arms.BenchEnv, "create", staticmethod(lambda *a: object()))
    monkeypatch.setattr(command, "header", lambda env, argv: {})
    monkeypatch.setattr(command, "header_lines", lambda head: [])
    monkeypatch.setattr(chaos, "run_chaos", run_chaos)
    argv = ["bench", "chaos", "--seed", "7", "--faults", "10", "--workdir", str(tmp_path)]
    assert cli.main(argv) == code


def test_the_added_faults_break_the_run_when_asked_and_not_shown() -> None:
    base = (0, 0, 0, 0, 0, 10, 10, 3, 4)
    assert Verdict(*base, disk_wanted=True).violations() == [
        "the full disk was asked for and did not run"
    ]
    assert Verdict(*base, disk_wanted=True, disk_ran=True).violations() == [
        "no save committed after the full disk was freed"
    ]
    assert Verdict(*base, disk_wanted=True, disk_ran=True, disk_resumed=True).violations() == []
    assert Verdict(*base, timing_wanted=True).violations() == ["no cross-tenant timing pair ran"]
    told = Verdict(*base, timing_wanted=True, timing_pairs=4, timing_differing=1)
    assert told.violations() == ["1 cross-tenant pairs told apart by headers or cache_n"]
    pair = TimingPair(
        1,
        0.1,
        0.1,
        {"cache_n": "12", "X-KVProxy-Cache": "miss"},
        {"cache_n": "1", "X-KVProxy-Cache": "miss"},
    )
    shown = Verdict(
        *base, timing_wanted=True, timing_pairs=4, timing_differing=1, timing_seen=(pair.told(),)
    )
    assert shown.violations() == [
        "1 cross-tenant pairs told apart by headers or cache_n [cache_n: same '12', control '1']"
    ]


def test_slow_clients_effect_is_the_ratio_of_medians() -> None:
    effect = SlowEffect(
        without={"chat": [0.1, 0.2, 0.3], "/tokenize": [0.01, 0.01]},
        with_slow={"chat": [0.2, 0.4, 0.9], "/tokenize": [0.01, 0.03]},
    )
    assert effect.ratio("chat") == pytest.approx(2.0)
    assert effect.ratio("/tokenize") == pytest.approx(2.0)
    assert effect.worst() == pytest.approx(2.0)
    assert SlowEffect(without={"chat": [0.1]}).worst() is None
    assert [r[0] for r in effect.rows()] == ["chat", "/tokenize"]


def test_timing_pairs_are_told_apart_only_by_what_a_client_sees() -> None:
    messages = [
        {"role": "system", "content": "Project 1003: facts."},
        {"role": "user", "content": "What of project 1003?"},
    ]
    control = renumbered(messages, 1003, 9001)
    assert [m["content"] for m in control] == ["Project 9001: facts.", "What of project 9001?"]
    seen = {"X-KVProxy-Cache": "miss", "cache_n": "0"}
    same = TimingPair(1003, 0.5, 0.4, seen, dict(seen))
    other = TimingPair(1003, 0.1, 0.4, {**seen, "X-KVProxy-Cache": "resident"}, seen)
    assert not same.differ and other.differ
    probes = TimingProbes([same, other])
    assert probes.differing() == 1 and probes.p50("control") == pytest.approx(0.4)
