"""The cache's decisions, on plain data: no I/O, no clock, no server.

For each keyed request: use what the slot holds, restore a longer prefix from disk, or start
cold (`choose`); whether what a slot holds is worth a save before it is lost
(`worth_saving`); whether a restore was reused by the server (`judge_restore`), and when
restoring stops paying for a namespace (`RestoreGuard`). The plan (plan.py) and
prepare.py ask; cache/slotio/slotwork.py does the I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Literal

# Restores the server did not reuse, in a row, before kvproxy stops restoring a namespace.
INEFFECTIVE_LIMIT = 3


class Decision(StrEnum):
    """What the cache did for a request: its X-KVProxy-Cache header and metrics label."""

    RESIDENT = "resident"  # the slot held its own earlier state (cache/reports/labels.py)
    RESTORED = "restored"  # the state came back from disk
    MISS = "miss"  # nothing of its own was cached (a shared opening may be: cache_n)
    BYPASS = "bypass"  # not keyed (no messages, n > 1, other routes)
    BUSY = "busy"  # refused: every slot busy and the queue full


class Move(Enum):
    USE_RESIDENT = "use-resident"
    RESTORE = "restore"
    START_COLD = "start-cold"


@dataclass(frozen=True)
class HeldView:
    """What a slot holds, as far as the decisions care."""

    namespace: str
    chain: Sequence[str]
    n_tokens: int
    saved: bool  # also on disk (or not worth keeping)


def choose(resident_depth: int, stored_depth: int | None, restores_allowed: bool) -> Move:
    """Restore only what the slot does not already hold more of: a resident prefix costs no
    I/O, and a restore replaces the slot's whole content."""
    if stored_depth is not None and stored_depth > resident_depth and restores_allowed:
        return Move.RESTORE
    if resident_depth > 0:
        return Move.USE_RESIDENT
    return Move.START_COLD


# --- which state serves a request, by model class (measured on llama-server: restored SWA
# states only serve shallow divergences). A state restored from disk has no context
# checkpoints: dense models reuse any common prefix of it; sliding-window ones (--swa-full)
# only a divergence near its end; recurrent and hybrid ones only a prompt that extends it. A
# live state (computed on the slot) is not limited by this.

RestoreRule = Literal["prefix", "window", "extension"]


@dataclass(frozen=True)
class ReuseRule:
    rule: RestoreRule
    window: int = 0  # "window": how far before a restored state's end a divergence is served
    # "window", with the tokens before the divergence counted by the server's tokenizer: the
    # server reuses a restored state where it parts after the SWA cache's oldest position,
    # n_swa before its end (server-context.cpp `pos_min_thold`, with --swa-full n_swa = 0
    # there but the SWA cells older than the window are not in the saved state).
    counted: int = 0


def reuse_rule(model_class: str, n_swa: int = 0) -> ReuseRule:
    """The rule for states restored from disk. The window is half the model's sliding
    window: measured, a divergence within ~n_swa of the end is served; half is margin for
    the tokens a template adds after a boundary. An unknown model keeps the longest match
    (the restore guard stops restores that are never reused)."""
    if model_class in ("recurrent", "hybrid"):
        return ReuseRule("extension")
    if model_class == "swa":
        return ReuseRule("window", max(n_swa // 2, 0), max(n_swa - COUNTED_MARGIN, 0))
    return ReuseRule("prefix")


@dataclass(frozen=True)
class StoredView:
    """A stored entry as the choice sees it."""

    depth: int  # boundaries it holds (len(chain))
    shared: int  # of them, how many the request shares
    n_tokens: int


def restore_serves(rule: ReuseRule, request_depth: int, stored: StoredView) -> bool:
    """Would the server reuse `stored`, restored, for a request of `request_depth` keys?"""
    if stored.shared <= 0:
        return False
    at_end = stored.shared == stored.depth
    if rule.rule == "extension":
        return at_end and request_depth > stored.depth
    if rule.rule == "window":
        # At the end: the request diverges where the entry's canonical prefix stops.
        return at_end or stored.n_tokens <= rule.window
    return True


def pick_stored(
    rule: ReuseRule, request_depth: int, candidates: Sequence[StoredView]
) -> int | None:
    """The index of the candidate that will actually be reused the most (the most shared
    boundaries; then the shortest, least to load), or None when none would be."""
    best: int | None = None
    for i, c in enumerate(candidates):
        if not restore_serves(rule, request_depth, c):
            continue
        if best is None or (c.shared, -c.depth) > (
            candidates[best].shared,
            -candidates[best].depth,
        ):
            best = i
    return best


# Tokens kept clear of the window's edge when the divergence is counted: the state's last
# position and the first new token (`has_new_tokens`), and a few more.
COUNTED_MARGIN = 16

# How many boundaries before a stored entry's end a request may part from it and still be
# worth counting the tokens after the divergence (window rule): a client's last turn.
NEAR_END_BOUNDARIES = 4


def near_end_candidate(
    rule: ReuseRule, candidates: Sequence[StoredView], picked: int | None
) -> int | None:
    """Window rule: the candidate sharing more boundaries than the picked one that the
    request parts from within its last few (a rewritten or edited last turn). It serves if
    the tokens after the divergence fit in the window (`window_serves`), which only the
    server's tokenizer can tell: the caller counts them, for this candidate alone."""
    if rule.rule != "window":
        return None
    floor = candidates[picked].shared if picked is not None else 0
    best: int | None = None
    for i, c in enumerate(candidates):
        if not floor < c.shared < c.depth or c.depth - c.shared > NEAR_END_BOUNDARIES:
            continue
        # The most shared; then the shortest, the likeliest to end within the window.
        if best is None or (c.shared, -c.n_tokens) > (
            candidates[best].shared,
            -candidates[best].n_tokens,
        ):
            best = i
    return best


def window_serves(rule: ReuseRule, stored: StoredView, tokens_before: int) -> bool:
    """Does a restored state serve a request parting from it after `tokens_before` tokens
    (counted, so the margin for uncounted template tokens is not needed)?"""
    return rule.rule == "window" and 0 < stored.n_tokens - tokens_before <= rule.counted


def resident_serves(rule: ReuseRule, shared: int, restored_depth: int, n_tokens: int) -> bool:
    """Can a slot serve a request sharing `shared` boundaries with what it holds? A live
    state (restored_depth 0) or a divergence at or beyond the restored part always can;
    inside a restored part only as `restore_serves` says (`n_tokens`: what the slot holds)."""
    if shared <= 0:
        return False
    if restored_depth <= 0 or shared >= restored_depth:
        return True
    if rule.rule == "window":
        return n_tokens <= rule.window
    return rule.rule == "prefix"


def worth_saving(
    held: HeldView | None,
    *,
    disk_enabled: bool,
    restores_allowed: bool,
    min_tokens: int,
) -> bool:
    """Is the slot's content not on disk, and worth keeping? Not for a namespace whose
    restores are never reused (it would never be restored). Whether a request would lose it
    is the plan's (handlers/plan.py: a request going on from it loses nothing)."""
    if held is None or held.saved or not disk_enabled or not restores_allowed:
        return False
    return held.n_tokens >= min_tokens


class RestoreVerdict(Enum):
    REUSED = "reused"
    WASTED = "wasted"
    UNKNOWN = "unknown"  # the reply had no timings


def judge_restore(
    n_restored: int | None, cache_n: int | None, prompt_n: int | None
) -> RestoreVerdict:
    """Did the server reuse what was restored? Some model/flag combinations never do
    (sliding-window models without --swa-full)."""
    return judge_reuse(n_restored, cache_n, prompt_n)


def judge_reuse(expected: int | None, cache_n: int | None, prompt_n: int | None) -> RestoreVerdict:
    """Did the server reuse what a resident or restored decision expected? At most the prompt
    less its last token can be reused; half of what could have been counts as reuse."""
    if cache_n is None or expected is None:
        return RestoreVerdict.UNKNOWN
    could = min(expected, cache_n + (prompt_n or 0) - 1)
    return RestoreVerdict.REUSED if cache_n >= could // 2 else RestoreVerdict.WASTED


def expected_resident(depth: int, chain_length: int, n_tokens: int) -> int | None:
    """What a slot holding `n_tokens` should give a request that shares `depth` of its
    `chain_length` keys: all of it when the request continues everything the slot holds;
    unknown in tokens when it parts inside (a branch), so not judged."""
    return n_tokens if depth >= chain_length else None


Scope = tuple[str, str, bool]  # (server life, namespace, entry saved before that life)


@dataclass
class RestoreGuard:
    """What restores the server did not reuse prove, and only that. Proofs hold for one
    start of one server (`life`: cache/servers/backend.py names each), whose settings may differ
    from the ones an entry was saved under in ways no fingerprint shows (a template given some
    way kvproxy cannot read). An entry restored and not reused, or refused, is set aside for
    that life (`set_aside`), never deleted. `limit` such restores in a row of one namespace's
    entries saved before the life began stop restores of its older entries (they were computed
    some other way); of entries saved during it, they stop its restores and saves altogether
    (this server reuses no restored state: a sliding-window model without --swa-full). New
    conversations are saved and restored as before in the first case."""

    limit: int = INEFFECTIVE_LIMIT
    _streak: dict[Scope, int] = field(default_factory=dict)
    _off: set[Scope] = field(default_factory=set)
    _aside: set[tuple[str, str]] = field(default_factory=set)  # (life, entry key)

    def allows(self, life: str, namespace: str, key: str, older: bool) -> bool:
        """May this entry (`older`: saved before `life` began) be restored now?"""
        if (life, key) in self._aside:
            return False
        off = self._off
        return (life, namespace, older) not in off and (life, namespace, False) not in off

    def allows_saves(self, life: str, namespace: str) -> bool:
        """Would a state of `namespace` saved now ever be reused by this server?"""
        return (life, namespace, False) not in self._off

    def set_aside(self, life: str, key: str) -> None:
        self._aside.add((life, key))

    def set_aside_for(self, life: str, key: str) -> bool:
        """Was this entry refused, or restored and not reused, by this server (`life`)?"""
        return (life, key) in self._aside

    def record(
        self, life: str, namespace: str, key: str, older: bool, verdict: RestoreVerdict
    ) -> bool:
        """True when this verdict stopped restores for the scope (`older`'s entries)."""
        if verdict is RestoreVerdict.UNKNOWN:
            return False
        scope = (life, namespace, older)
        if verdict is RestoreVerdict.REUSED:
            self._streak[scope] = 0
            return False
        self.set_aside(life, key)
        streak = self._streak.get(scope, 0) + 1
        self._streak[scope] = streak
        if streak >= self.limit and scope not in self._off:
            self._off.add(scope)
            return True
        return False
