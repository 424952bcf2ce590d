"""`chaos`'s decisions on plain data: what each request is, which fault comes next and when,
what a request's ending means, and which results break a promise. No I/O here (chaos.py
drives the processes and the requests), so every rule is unit-tested without a server.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum

from kvproxy.keys import shared_prefix


class Wire(StrEnum):
    """The API a conversation speaks, for all its turns."""

    CHAT = "chat"
    MESSAGES = "messages"
    RESPONSES = "responses"


class Kind(StrEnum):
    """One request of the workload."""

    CHAT = "chat"
    CHAT_STREAM = "chat, streamed"
    HANG_UP = "chat, hang-up mid-stream"
    MESSAGES = "/v1/messages"
    MESSAGES_STREAM = "/v1/messages, streamed"
    RESPONSES = "/v1/responses"
    COMPLETION = "/completion"
    METRICS = "/metrics scrape"
    PROBE = "cross-tenant probe"


class Fault(StrEnum):
    KILL_PROXY = "SIGKILL kvproxy"
    KILL_SERVER = "SIGKILL llama-server"


class Outcome(StrEnum):
    """How a request ended, as its client saw it."""

    OK = "200, whole answer"
    HUNG_UP = "client hung up (on purpose)"
    STREAM_ERROR = "stream ended with an error event"
    CUT_OFF = "connection dropped mid-answer"
    REFUSED = "connection refused"
    BAD_GATEWAY = "502"
    BUSY = "503"
    SERVER_500 = "500 relayed from llama-server"
    KVPROXY_500 = "kvproxy's own 500"
    OTHER = "other status"
    STUCK = "stuck (no answer within the bound)"


# Outcomes that break a promise whatever faults were injected.
BROKEN = frozenset({Outcome.KVPROXY_500, Outcome.STUCK})

# The turns a conversation's wire offers, with their weights.
_TURNS: dict[Wire, tuple[tuple[Kind, int], ...]] = {
    Wire.CHAT: ((Kind.CHAT, 3), (Kind.CHAT_STREAM, 3), (Kind.HANG_UP, 2)),
    Wire.MESSAGES: ((Kind.MESSAGES, 2), (Kind.MESSAGES_STREAM, 1)),
    Wire.RESPONSES: ((Kind.RESPONSES, 1),),
}
# Requests that belong to no conversation of their own, with their chance per request.
_SIDE = ((Kind.PROBE, 0.12), (Kind.METRICS, 0.08), (Kind.COMPLETION, 0.08))


def wire_of(conversation: int) -> Wire:
    """Half the conversations chat, a quarter each speak Messages and Responses."""
    return (Wire.CHAT, Wire.MESSAGES, Wire.CHAT, Wire.RESPONSES)[conversation % 4]


def side_request(rng: random.Random) -> Kind | None:
    """A probe, a scrape or a raw completion instead of a conversation's turn, or None."""
    draw = rng.random()
    for kind, chance in _SIDE:
        if draw < chance:
            return kind
        draw -= chance
    return None


def turn_kind(rng: random.Random, wire: Wire) -> Kind:
    kinds = [k for k, _ in _TURNS[wire]]
    return rng.choices(kinds, [w for _, w in _TURNS[wire]])[0]


def fault_plan(rng: random.Random, n: int) -> list[Fault]:
    """`n` faults, as many of each kind as can be (kvproxy's first), in a seeded order."""
    faults = [Fault.KILL_PROXY if i % 2 == 0 else Fault.KILL_SERVER for i in range(n)]
    rng.shuffle(faults)
    return faults


def fault_due(index: int, faults: int, requests: int) -> int:
    """Fault `index` (0-based) comes once this many requests were answered: evenly through
    the run, none at its very start or end, so every fault lands in the middle of work."""
    return (index + 1) * requests // (faults + 1)


def classify(
    status: int | None,
    *,
    timed_out: bool = False,
    refused: bool = False,
    hung_up: bool = False,
    complete: bool = True,
    error_event: bool = False,
    proxy_error: bool = False,
) -> Outcome:
    """A request's ending. `status` None: no response head arrived. `complete`: the body or
    stream reached its end; `error_event`: the stream's last event is an error (the server
    broke off); `proxy_error`: a 500 body that is kvproxy's own (or no JSON at all, as
    aiohttp writes for an unhandled exception) rather than the server's error object."""
    if timed_out:
        return Outcome.STUCK
    if hung_up:
        return Outcome.HUNG_UP
    if status is None:
        return Outcome.REFUSED if refused else Outcome.CUT_OFF
    if status == 500:
        return Outcome.KVPROXY_500 if proxy_error else Outcome.SERVER_500
    if status == 502:
        return Outcome.BAD_GATEWAY
    if status == 503:
        return Outcome.BUSY
    if status != 200:
        return Outcome.OTHER
    if error_event:
        return Outcome.STREAM_ERROR
    return Outcome.OK if complete else Outcome.CUT_OFF


def cross_tenant(cache_state: str, cache_n: int, allowed: int) -> bool:
    """A probe is a tenant never seen before sending another tenant's conversation byte for
    byte. kvproxy may never call that a hit, and the server may reuse no more of it than the
    tokens it shares with every other conversation (the template and the system prompt's
    first words), which any slot may hold: more means it read another tenant's state."""
    return cache_state in ("resident", "restored") or cache_n > allowed


# Nats between the server's own top two tokens within which it may pick either: llama-server
# alone computes the same prompt's logits up to ~0.005 apart depending on whether its tokens
# were decoded one by one (a resident turn) or prefilled in a batch (a fresh slot). Measured
# on the tiny random-weight model, whose logits are nearly flat.
TIE_NATS = 0.02


def parts_at_a_tie(
    tokens: list[tuple[bytes, float, float | None]], ours: str, theirs: str
) -> float | None:
    """Where `ours` parts from the server alone's answer `theirs` (its `tokens`: bytes, top
    logprob, runner-up logprob), the margin between its top two if they were within
    TIE_NATS there: the answers differ by a coin the server itself tosses. None otherwise."""
    parted = shared_prefix(ours, theirs)
    done = b""
    for piece, best, runner_up in tokens:
        before = len(done.decode("utf-8", "replace"))
        done += piece
        after = len(done.decode("utf-8", "replace"))
        # The token whose text holds the first character that differs (a character split over
        # byte tokens decodes to one replacement character until it is whole: `<=`).
        holds = before <= parted <= after
        if holds and runner_up is not None and best - runner_up <= TIE_NATS:
            return best - runner_up
        if before > parted:
            break
    return None


@dataclass
class Tally:
    """Requests by kind and outcome."""

    counts: Counter[tuple[Kind, Outcome]] = field(default_factory=Counter)

    def add(self, kind: Kind, outcome: Outcome) -> None:
        self.counts[(kind, outcome)] += 1

    def total(self, outcome: Outcome | None = None) -> int:
        return sum(n for (_, o), n in self.counts.items() if outcome is None or o is outcome)

    def by_outcome(self) -> dict[Outcome, int]:
        out: Counter[Outcome] = Counter()
        for (_, outcome), n in self.counts.items():
            out[outcome] += n
        return {o: out[o] for o in Outcome if out[o]}


@dataclass
class Verdict:
    """What the run must show, each a count that has to be 0 (or a floor it must reach)."""

    kvproxy_500s: int
    stuck: int
    invalid_entries: int
    answers_differing: int  # beyond a tie of the server's own top two (see parts_at_a_tie)
    cross_tenant_reads: int
    faults_injected: int
    faults_wanted: int
    restored_checked: int
    probes: int
    # The faults and probes a run may add (ChaosOptions): asked for, then what they showed.
    disk_wanted: bool = False
    disk_ran: bool = False
    disk_resumed: bool = False  # a save committed after the full disk was freed
    timing_wanted: bool = False
    timing_pairs: int = 0
    timing_differing: int = 0  # pairs a tenant tells apart by X-KVProxy headers or cache_n
    timing_seen: tuple[str, ...] = ()  # what each side of those pairs saw, to read why

    def violations(self) -> list[str]:
        out = []
        if self.kvproxy_500s:
            out.append(f"{self.kvproxy_500s} kvproxy 500s")
        if self.stuck:
            out.append(f"{self.stuck} stuck requests")
        if self.invalid_entries:
            out.append(f"{self.invalid_entries} invalid committed entries")
        if self.answers_differing:
            out.append(f"{self.answers_differing} answers differ from the server alone")
        if self.cross_tenant_reads:
            out.append(f"{self.cross_tenant_reads} cross-tenant reads")
        if self.faults_injected < self.faults_wanted:
            out.append(f"only {self.faults_injected} of {self.faults_wanted} faults injected")
        # A check that never ran proves nothing: the run fails rather than pass on it.
        if self.restored_checked == 0:
            out.append("no conversation was restored at the end: nothing compared")
        if self.probes == 0:
            out.append("no cross-tenant probe ran")
        if self.disk_wanted and not self.disk_ran:
            out.append("the full disk was asked for and did not run")
        if self.disk_ran and not self.disk_resumed:
            out.append("no save committed after the full disk was freed")
        if self.timing_wanted and self.timing_pairs == 0:
            out.append("no cross-tenant timing pair ran")
        if self.timing_differing:
            out.append(
                f"{self.timing_differing} cross-tenant pairs told apart by headers or cache_n"
                + "".join(f" [{seen}]" for seen in self.timing_seen)
            )
        return out
