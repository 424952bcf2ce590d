"""Which state serves a request, by model class (cache/decisions/policy.py), and opening entries
(cache/prefixes/openings.py): plain data first, then the fake server (`reuse="window"` for SWA after a
restore, `reuse="extend"` for recurrent models)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from kvproxy.cache.decisions.policy import (
    StoredView,
    near_end_candidate,
    pick_stored,
    resident_serves,
    restore_serves,
    reuse_rule,
    window_serves,
)
from kvproxy.server.modelinfo import ModelClass, ModelInfo

from .conftest import Maker, RunningProxy
from .fakeserver import render_chat
from .test_cache import chat, settle, then

DENSE, SWA, RECURRENT = reuse_rule("dense"), reuse_rule("swa", 512), reuse_rule("recurrent")


def test_rules_by_model_class() -> None:
    assert reuse_rule("dense") == DENSE
    assert reuse_rule("swa", 512) == SWA, "half the window: a conservative margin"
    assert reuse_rule("recurrent") == RECURRENT
    assert reuse_rule("hybrid") == RECURRENT
    assert reuse_rule("unknown") == DENSE


# An opening entry (the system prompt, 1 boundary) and a 5-boundary conversation that a new
# session (2 boundaries) shares only the system prompt with.
OPENING = StoredView(depth=1, shared=1, n_tokens=2000)
LONG = StoredView(depth=5, shared=1, n_tokens=2600)


def test_dense_reuses_any_common_prefix() -> None:
    assert restore_serves(DENSE, 2, LONG) and restore_serves(DENSE, 2, OPENING)
    deeper = StoredView(depth=5, shared=3, n_tokens=2600)
    assert pick_stored(DENSE, 4, [OPENING, deeper]) == 1, "the longest match"


def test_swa_after_a_restore_only_serves_a_divergence_near_the_end() -> None:
    assert not restore_serves(SWA, 2, LONG), "diverges 600 tokens before its end"
    assert restore_serves(SWA, 2, OPENING), "the request extends it"
    assert restore_serves(SWA, 2, StoredView(depth=5, shared=1, n_tokens=200)), "all in window"
    assert restore_serves(SWA, 5, StoredView(depth=5, shared=5, n_tokens=9000)), "same end"
    assert pick_stored(SWA, 2, [LONG, OPENING]) == 1, "the opening, not the longer match"
    assert pick_stored(SWA, 2, [LONG]) is None


def test_recurrent_only_serves_an_exact_extension() -> None:
    assert restore_serves(RECURRENT, 2, OPENING)
    assert not restore_serves(RECURRENT, 2, LONG)
    assert not restore_serves(RECURRENT, 1, OPENING), "equal, not an extension"
    assert not restore_serves(RECURRENT, 2, StoredView(depth=5, shared=1, n_tokens=10))
    assert pick_stored(RECURRENT, 2, [LONG, OPENING]) == 1
    assert pick_stored(RECURRENT, 6, [StoredView(5, 5, 900), OPENING]) == 0, "the deepest"


def test_nothing_shared_serves_nothing() -> None:
    for rule in (DENSE, SWA, RECURRENT):
        assert not restore_serves(rule, 3, StoredView(depth=2, shared=0, n_tokens=10))
        assert not resident_serves(rule, 0, 0, 10)


def test_a_resident_state_from_disk_serves_what_its_class_allows() -> None:
    for rule in (DENSE, SWA, RECURRENT):
        assert resident_serves(rule, 1, 0, 5000), "computed on the slot: any divergence"
        assert resident_serves(rule, 3, 3, 5000), "at the restored end"
        assert resident_serves(rule, 4, 3, 5000), "beyond it"
    assert resident_serves(DENSE, 1, 3, 5000)
    assert not resident_serves(SWA, 1, 3, 5000)
    assert resident_serves(SWA, 1, 3, 200), "everything within the window"
    assert not resident_serves(RECURRENT, 1, 3, 200)


# --- the fake server

SYSTEM = "You are an agent. " + "Follow the rules. " * 230  # ~4,200 characters


def session(n: int, system: str = SYSTEM) -> list[dict[str, Any]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": f"task {n}"}]


def as_class(proxy: RunningProxy, model_class: ModelClass, n_swa: int = 0) -> None:
    proxy.cache.backend.model_info = ModelInfo(
        Path("/models/fake.gguf"), n_swa=n_swa, has_swa=n_swa > 0, model_class=model_class
    )


def system_tokens(system: str = SYSTEM) -> int:
    """The fake's tokens (one per byte) up to the end of the system message."""
    return len(system.encode())


@pytest.mark.parametrize(
    ("reuse", "model_class", "n_swa"),
    [("window", "swa", 1024), ("extend", "recurrent", 0), ("full", "dense", 0)],
)
async def test_a_new_session_starts_from_the_opening(
    make: Maker, reuse: str, model_class: ModelClass, n_swa: int
) -> None:
    """A (a long system prompt and two turns) is evicted by two unrelated conversations; a
    new session B with the same system prompt restores the opening entry, not A. On a dense
    model no opening is presumed: B restores A, whose common prefix the server reuses."""
    fake, proxy = await make({"reuse": reuse, "window": n_swa // 2 or 512, "n_ctx": 16384})
    as_class(proxy, model_class, n_swa)
    _, r, _ = await chat(proxy, session(1))
    as_class(proxy, model_class, n_swa)
    a2 = then(session(1), r, "and now " + "more " * 200)
    _, r2, h = await chat(proxy, a2)
    assert h["X-KVProxy-Cache"] == "resident"
    for other in ("X", "Y"):
        await chat(proxy, session(9, f"Other system {other}. " + "pad " * 100))
    await settle(proxy)
    store = proxy.cache.store
    openings = [e for e in store.entries.values() if len(e.chain) == 1]
    assert len(openings) == (0 if model_class == "dense" else 1), store.entries
    restored_entry = (
        openings[0] if openings else max(store.entries.values(), key=lambda e: len(e.chain))
    )
    assert restored_entry.n_tokens >= system_tokens()

    status, body, h = await chat(proxy, session(2))
    assert status == 200
    assert h["X-KVProxy-Cache"] == "restored"
    assert int(h["X-KVProxy-Restored-Tokens"]) == restored_entry.n_tokens
    assert body["timings"]["cache_n"] >= system_tokens()


async def test_swa_resident_from_disk_is_not_claimed_when_it_cannot_serve(make: Maker) -> None:
    """A slot holding a state restored from disk (SWA) that a new session shares only the
    system prompt with: not `resident` (the server would reuse nothing), the opening."""
    fake, proxy = await make({"reuse": "window", "window": 512, "n_ctx": 16384})
    _, r, _ = await chat(proxy, session(1))
    as_class(proxy, "swa", 1024)
    a2 = then(session(1), r, "and now " + "more " * 200)
    _, r2, _ = await chat(proxy, a2)
    for other in ("X", "Y"):
        await chat(proxy, session(9, f"Other system {other}. " + "pad " * 100))
    await settle(proxy)
    _, _, h = await chat(proxy, then(a2, r2, "third"))  # A comes back from disk
    assert h["X-KVProxy-Cache"] == "restored"
    await settle(proxy)
    status, body, h = await chat(proxy, session(3))
    assert h["X-KVProxy-Cache"] == "restored", "the opening, restored over A's slot"
    assert body["timings"]["cache_n"] >= system_tokens()


async def test_an_observed_opening_is_made_when_a_new_session_lands_on_the_slot(
    make: Maker,
) -> None:
    """A short system prompt (not presumed): the second session that shares it shows it is
    shared; it lands on the first session's live slot, which is saved, cut to the opening and
    saved as the opening entry; the new session is served from it."""
    fake, proxy = await make()
    short = "Short agent prompt. " + "x " * 200
    _, r, _ = await chat(proxy, session(1, short))
    await chat(proxy, then(session(1, short), r, "go on"))
    await settle(proxy)
    assert not proxy.cache.store.entries
    status, body, h = await chat(proxy, session(2, short))
    # Served from the opening in its slot: a new session's miss, its reuse in cache_n.
    assert status == 200 and h["X-KVProxy-Cache"] == "miss"
    assert body["timings"]["cache_n"] >= system_tokens(short)
    chains = sorted(len(e.chain) for e in proxy.cache.store.entries.values())
    assert chains == [1, 5], "the opening, and the first session kept"


async def test_a_deeper_shared_opening_is_saved_on_the_way_from_a_shorter_one(
    make: Maker,
) -> None:
    """Codex's shape on a recurrent model (a restored state serves only an exact extension):
    a long system prompt (presumed an opening) and a context message every session repeats.
    The second session restores the system prompt's opening and shows the context is shared
    too: kvproxy evaluates through the context and saves that opening before the request
    extends it (saying so), so the third session restores it all."""
    fake, proxy = await make({"reuse": "extend", "n_ctx": 16384})
    context = {"role": "user", "content": "<environment_context>cwd /w " + "x " * 300}

    def codex(n: int) -> list[dict[str, Any]]:
        return [session(n)[0], context, {"role": "user", "content": f"task {n}"}]

    async def crowd(n: int) -> None:
        for other in ("X", "Y"):
            await chat(proxy, session(n, f"Other system {other}{n}. " + "pad " * 100))
        await settle(proxy)

    _, r, h = await chat(proxy, codex(1))
    as_class(proxy, "recurrent")
    assert "X-KVProxy-Evaluated-Tokens" in h, "the system prompt's opening, on the way"
    await crowd(1)
    system_only = system_tokens()

    status, body, h = await chat(proxy, codex(2))
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    restored = int(h["X-KVProxy-Restored-Tokens"])
    assert system_only <= restored < system_only + 100  # + the next message's markup
    evaluated = int(h["X-KVProxy-Evaluated-Tokens"])
    assert evaluated >= len(context["content"])
    assert body["timings"]["cache_n"] >= restored + evaluated
    await settle(proxy)
    depths = sorted(len(e.chain) for e in proxy.cache.store.entries.values() if len(e.chain) < 3)
    assert depths == [1, 2], proxy.cache.store.entries
    await crowd(2)

    status, body, h = await chat(proxy, codex(3))
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    assert int(h["X-KVProxy-Restored-Tokens"]) >= restored + evaluated
    assert "X-KVProxy-Evaluated-Tokens" not in h
    assert body["timings"]["cache_n"] >= restored + evaluated


async def test_a_new_session_restores_what_it_shares_near_an_entrys_end(make: Maker) -> None:
    """The same shape on a sliding-window model: session 1's first state parts from a new
    session only at its task message, within the window of its end, so it serves the
    system prompt and the context at once."""
    fake, proxy = await make({"reuse": "window", "window": 512, "n_ctx": 16384})
    context = {"role": "user", "content": "<environment_context>cwd /w " + "x " * 300}
    shared = [session(1)[0], context]
    await chat(proxy, [*shared, {"role": "user", "content": "task 1"}])
    as_class(proxy, "swa", 1024)
    for other in ("X", "Y"):
        await chat(proxy, session(9, f"Other system {other}. " + "pad " * 100))
    await settle(proxy)
    status, body, h = await chat(proxy, [*shared, {"role": "user", "content": "task 2"}])
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    assert body["timings"]["cache_n"] >= len(render_chat(shared, False).encode())


def test_a_near_end_divergence_is_counted_only_on_sliding_window_models() -> None:
    conv_entry = StoredView(depth=4, shared=2, n_tokens=10_395)  # parts 2 from its end
    opening = StoredView(depth=1, shared=1, n_tokens=10_092)
    views = [conv_entry, opening]
    picked = pick_stored(SWA, 5, views)
    assert picked == 1  # by boundaries alone only the opening serves
    assert near_end_candidate(SWA, views, picked) == 0
    assert window_serves(SWA, conv_entry, 10_247)  # 148 tokens after the divergence
    assert window_serves(SWA, conv_entry, 10_053)  # aider's: 342 of Gemma 3's 512
    assert not window_serves(SWA, conv_entry, 9_880)  # 515: beyond the window
    assert near_end_candidate(DENSE, views, pick_stored(DENSE, 5, views)) is None
    assert near_end_candidate(RECURRENT, views, picked) is None
    far = StoredView(depth=12, shared=2, n_tokens=20_000)  # a branch far back
    assert near_end_candidate(SWA, [far, opening], 1) is None


async def test_a_rewritten_last_turn_restores_the_conversation_when_the_window_allows(
    make: Maker,
) -> None:
    """OpenClaw's turn 2 before its habit is known: it drops turn 1's context message, so
    the saved state parts from it two messages before its end. On a sliding-window model
    that state still serves everything before the divergence (within the window of its
    end): restored, not the shorter opening."""
    fake, proxy = await make({"reuse": "window", "window": 512, "n_ctx": 16384})
    context = {"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> t1 " + "c " * 40}
    first = [*session(1), context]
    _, r, _ = await chat(proxy, first)
    as_class(proxy, "swa", 1024)
    for other in ("X", "Y"):
        await chat(proxy, session(9, f"Other system {other}. " + "pad " * 100))
    await settle(proxy)
    reply = {"role": "assistant", "content": r["choices"][0]["message"]["content"]}
    turn2 = [*session(1), reply, {"role": "user", "content": "go on"}, context]
    status, body, h = await chat(proxy, turn2)
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    before_context = len(render_chat(session(1), add_generation_prompt=False).encode())
    assert int(h["X-KVProxy-Restored-Tokens"]) > before_context
    assert body["timings"]["cache_n"] >= before_context


async def test_a_restore_the_request_parts_from_early_is_not_judged_wasted(make: Maker) -> None:
    """A near-end restore of a short state may reuse less than half of it, as expected: it
    is not counted as a wasted restore (that would turn restores off for the namespace)."""
    fake, proxy = await make({"reuse": "window", "window": 512, "n_ctx": 16384})
    short = [{"role": "system", "content": "Be brief. " * 30}, {"role": "user", "content": "q1"}]
    context = {"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> " + "c " * 180}
    _, r, _ = await chat(proxy, [*short, context])
    as_class(proxy, "swa", 1024)
    for other in ("X", "Y"):
        await chat(proxy, session(9, f"Other system {other}. " + "pad " * 100))
    await settle(proxy)
    reply = {"role": "assistant", "content": r["choices"][0]["message"]["content"]}
    status, body, h = await chat(proxy, [*short, reply, {"role": "user", "content": "q2"}, context])
    assert status == 200 and h["X-KVProxy-Cache"] == "restored"
    restored, reused = int(h["X-KVProxy-Restored-Tokens"]), body["timings"]["cache_n"]
    assert 0 < reused < restored // 2, (reused, restored)
    await settle(proxy)
    assert proxy.stats()["ineffective_restores"] == 0


@pytest.mark.parametrize(
    ("reuse", "model_class", "n_swa"), [("window", "swa", 1024), ("extend", "recurrent", 0)]
)
async def test_sessions_starting_at_once_evaluate_their_opening_once(
    make: Maker, reuse: str, model_class: ModelClass, n_swa: int
) -> None:
    """Three sessions of one agent start at once, on 2 slots, before any slot holds their
    system prompt: one evaluates it (and saves it as the opening), the others restore it
    rather than evaluate it again (the server alone evaluates it once per slot)."""
    fake, proxy = await make(
        {"reuse": reuse, "window": n_swa // 2 or 512, "n_ctx": 16384, "prompt_delay": 0.0002}
    )
    as_class(proxy, model_class, n_swa)
    replies = await asyncio.gather(*(chat(proxy, session(n)) for n in (1, 2, 3)))
    evaluated = 0
    labels = []
    for status, body, h in replies:
        assert status == 200
        # What the server evaluated for the request: its prompt_n, and what kvproxy had it
        # evaluate before forwarding (counted in cache_n).
        evaluated += body["timings"]["prompt_n"] + int(h.get("X-KVProxy-Evaluated-Tokens", 0))
        labels.append(h["X-KVProxy-Cache"])
    assert evaluated < 2 * system_tokens(), (evaluated, labels)
    # New sessions all: none is `resident` (only a conversation's own state is); one at
    # least has the opening restored from disk.
    assert "resident" not in labels and "restored" in labels, labels
