"""Whether restoring a stored state pays, on plain data: reading it must not take longer than
prefilling what it gives back.

A restore reads the whole state file (its bytes over this server's measured read rate: the
bytes of its recent restores over their time, cache/servers/pace.py); what it gives back is the
tokens the request shares with it, which the server would otherwise prefill (at its measured
cold-prefill rate: prefillrate.py). Either way the request's own new tokens are prefilled after,
so they weigh on neither side. A short shared prefix inside a huge state (a new session sharing
only its system prompt with a long conversation), or a slow or network disk, can make the read
the dearer one; then the request is prefilled instead and the state is left on disk.

The rule errs toward restoring, kvproxy's behaviour before it measured anything: with no
measured rate it restores; it prefills only when the prefill is estimated at under half the
read (a cold-prefill rate learnt from shorter prompts errs fast, since attention grows with
the context); and when the request shares less than the whole state, the tokens it gets back
are counted from above, as the UTF-8 bytes of what it shares (a byte-level tokenizer never
makes more tokens than bytes) plus the template's markers, never more than the state holds.

The same price bounds how long a returning turn waits for its own state's save still under
way (`save_wait_s`): at least half a minute, and as long as prefilling that state would take,
since giving up sooner means that prefill (a 4 GiB state's fsync on a slow disk can take
longer than half a minute; its prefill takes minutes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

# Prefill only when it is estimated at less than the read time divided by this.
MARGIN = 2.0
# Tokens a chat template adds around each message (role markers, separators), at most.
TEMPLATE_TOKENS_PER_MESSAGE = 16
# How long a turn waits for its own state's save under way: at least this…
SAVE_WAIT_FLOOR_S = 30.0
# …and at most this, whatever its prefill would cost (a disk that hangs must not hold it).
SAVE_WAIT_CEILING_S = 900.0


class RestoreChoice(StrEnum):
    RESTORE = "restore"  # the read costs less than prefilling what it gives back
    PREFILL = "prefill"  # prefilling costs less: the state is not read
    UNMEASURED = "unmeasured"  # a rate is not measured yet: restored, as before


@dataclass(frozen=True)
class RestoreCost:
    """What a restore reads and gives back, and this server's measured rates (None: not
    measured yet)."""

    state_bytes: int
    tokens_back: int
    read_bytes_per_s: float | None
    prefill_tokens_per_s: float | None

    @property
    def read_s(self) -> float | None:
        rate = self.read_bytes_per_s
        return self.state_bytes / rate if rate else None

    @property
    def prefill_s(self) -> float | None:
        rate = self.prefill_tokens_per_s
        return self.tokens_back / rate if rate else None


def choose_restore(cost: RestoreCost) -> RestoreChoice:
    read_s, prefill_s = cost.read_s, cost.prefill_s
    if read_s is None or prefill_s is None or cost.state_bytes <= 0:
        return RestoreChoice.UNMEASURED
    return RestoreChoice.PREFILL if prefill_s * MARGIN < read_s else RestoreChoice.RESTORE


def tokens_back(
    state_tokens: int, shared: int, depth: int, messages: Sequence[Any], template: Any
) -> int:
    """The tokens a restore gives a request sharing `shared` of the state's `depth`
    boundaries: all of them when it goes on from the whole state, else at most what the
    shared messages (and the template's fields: tools, a system prompt) can tokenise to."""
    if shared >= depth:
        return state_tokens
    try:
        upper = len(orjson.dumps(list(messages[:shared]))) + len(orjson.dumps(template))
    except TypeError:  # not JSON after all: no bound but the state's own
        return state_tokens
    return min(state_tokens, upper + TEMPLATE_TOKENS_PER_MESSAGE * shared)


def save_wait_s(
    tokens: int | None, prefill_ms_per_token: float | None, floor: float = SAVE_WAIT_FLOOR_S
) -> float:
    """How long a turn waits for the save of its own state of `tokens` tokens (None: not
    known) before it goes on without it: `floor`, or the state's estimated prefill when
    longer, never past SAVE_WAIT_CEILING_S."""
    if not tokens or not prefill_ms_per_token:
        return floor
    return max(floor, min(tokens * prefill_ms_per_token / 1000, SAVE_WAIT_CEILING_S))
