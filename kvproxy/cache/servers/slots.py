"""What each llama-server slot holds, as kvproxy knows it, and every change of that by name.

A slot's picture changes only through the methods here (tests/test_layers.py checks it): a
reply recorded (`replied`), a client gone mid-reply (`interrupted`), a restore, a save, a
wipe seen on the server. Who may touch a slot now is the pool's (slotpool.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproxy import keys
from kvproxy.cache.decisions.policy import HeldView
from kvproxy.keys import shared_chain
from kvproxy.server.api import SlotInfo
from kvproxy.wire import Conversation

# A reply's length when nothing tells it (a Responses JSON reply gives usage only; a client
# gone mid-reply): any size from the prompt on.
UNKNOWN_REPLY_TOKENS = 1 << 30


@dataclass
class Holding:
    """A conversation as it sits in a slot."""

    namespace: str
    chain: list[str]  # prefix keys; chain[-1] is the key of everything the slot holds
    n_tokens: int
    n_messages: int
    messages: list[Any] = field(default_factory=list)  # as the client will echo them
    template: dict[str, Any] = field(default_factory=dict)  # request fields the template reads
    canonical: bool = False  # the slot holds exactly the next request's canonical prefix
    # Boundaries of `chain` that came from a restore (0: all computed on the slot). A restored
    # state cannot be cut back like a live one (policy.resident_serves).
    restored_depth: int = 0

    @property
    def key(self) -> str:
        return self.chain[-1]


# A slot's occupant when kvproxy cannot tell whose tokens it holds (a server that ran before
# this proxy started may hold any tenant's), and when the server showed it empty. Tenants are
# hashes (keys.tenant_of) or None.
ANYONE = "anyone"
NOBODY = "nobody"


@dataclass
class Slot:
    id: int
    holding: Holding | None = None
    saved: bool = True  # nothing in the slot that is not also on disk (or worth keeping)
    busy: bool = False
    last_used: float = 0.0
    changed_at: float = 0.0
    # (id_task, n_prompt_tokens) as GET /slots showed them right after our last use: if the
    # server shows anything else later, someone else used or wiped the slot.
    snapshot: tuple[Any, Any] | None = None
    seen_at: float = 0.0  # time.monotonic() when GET /slots last confirmed the snapshot
    # When kvproxy last gave the slot work: a server with idle-slot wiping may wipe every
    # other idle slot then.
    started_at: float = 0.0
    # The tenant whose tokens the server's slot may hold, whatever kvproxy knows of them
    # (`forget` keeps it): another tenant's request may only run there once it is erased.
    occupant: str | None = ANYONE
    # Taken for a background save (cache/scheduling/background_saves.py): soon idle, its content
    # then on disk.
    saving: bool = False
    # Its own conversation's next turn waits for it during a background save: the save gives
    # way unless its state write is already sent (the turn finds its state resident anyway,
    # and every step of a save waits for the server's loop, behind other slots' prefills).
    claimed: bool = False
    # How many times the slot was taken: a GET /slots sent after our use counts only if the
    # slot was not taken again before it answered.
    taken: int = 0
    # Our last use ended and its GET /slots has not answered yet (see `ours_ended`): the
    # range of tokens the server should show (the prompt, up to the prompt and the reply).
    pending: tuple[int, int] | None = None
    # The newest task GET /slots showed since the server started (`forget` keeps it).
    last_task: int | None = None
    # "saving" or "restoring" while kvproxy's save or restore of the slot is under way.
    action: str | None = None
    # The keys of the conversation a request taking the slot is for, until it is given back.
    serving: list[str] | None = None
    # Its request's reply is delivered and kvproxy's own work after it (a GET /slots, a
    # --write-through save) holds the slot: the server alone would find it idle.
    finishing: bool = False
    # Taken for a prefetch (cache/scheduling/prefetch.py): a conversation waiting for a tool's
    # result is restored into it (`serving` names that conversation).
    prefetching: bool = False
    # Its request waits for a moment to save what the slot holds (cache/scheduling/savegate.py):
    # not at work on the server yet.
    gated: bool = False

    def shared_depth(self, keys: Sequence[str], namespace: str) -> int:
        holding = self.holding
        if holding is None or holding.namespace != namespace:
            return 0
        return shared_chain(holding.chain, keys)

    @property
    def working(self) -> bool:
        """Busy with a request on the server (its prefill, its stream, its restore), not with
        kvproxy's own background work or bookkeeping: a save now would pause it."""
        return self.busy and not (self.saving or self.prefetching or self.finishing or self.gated)

    def view(self) -> HeldView | None:
        """What the slot holds, for the policy."""
        h = self.holding
        return None if h is None else HeldView(h.namespace, h.chain, h.n_tokens, self.saved)

    def forget(self) -> None:
        self.holding = None
        self.saved = True
        self.snapshot = None
        self.pending = None

    def hold(self, holding: Holding | None, saved: bool) -> None:
        old = self.holding
        if (
            holding is not None
            and old is not None
            and old.restored_depth
            and not (holding.restored_depth)
        ):
            # The slot went on from a restored state: that part is still the restored one.
            if old.namespace == holding.namespace:
                kept = min(old.restored_depth, shared_chain(old.chain, holding.chain))
                holding.restored_depth = kept
        self.holding = holding
        self.saved = saved
        self.changed_at = time.monotonic()

    def replied(
        self, conv: Conversation, echoed: Mapping[str, Any] | None, timings: Mapping[str, Any]
    ) -> None:
        """Our request's reply came whole: the slot holds the conversation and the reply as
        the client will echo it (`echoed`; None: the next request does not carry it, as a
        prompt's), that is the prompt and the reply but its last token, which was sampled and
        never evaluated (GET /slots would show the same). Trusted as that, with no GET /slots
        now: the next check (`SlotWork.verify`) wants a task newer than the last one seen and
        a token count from the prompt to the prompt and the reply (`ours_ended`)."""
        prompt = int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
        generated = timings.get("predicted_n")
        chain, messages = list(conv.keys), list(conv.messages)
        if echoed is not None:
            chain.append(keys.extend(conv.keys[-1], echoed))
            messages.append(dict(echoed))
        held = prompt + max(generated - 1, 0) if isinstance(generated, int) else prompt
        holding = Holding(conv.namespace, chain, held, len(chain), messages, dict(conv.template))
        self.hold(holding, saved=False)
        self.ours_ended(prompt, generated if isinstance(generated, int) else UNKNOWN_REPLY_TOKENS)

    def interrupted(self, conv: Conversation) -> None:
        """The client hung up mid-reply (a user's Esc or Ctrl-C): the slot holds the request's
        prompt and what was generated of the reply. The client's next turn starts with that
        prompt: resident for that turn, or saved when the slot is needed. How many tokens it
        holds is what the server shows once its task has ended (the next check asks); a server
        that never started the task shows the old one, and the slot is then forgotten."""
        chain = list(conv.keys)
        holding = Holding(
            conv.namespace, chain, 0, len(chain), list(conv.messages), dict(conv.template)
        )
        self.hold(holding, saved=False)
        self.ours_ended(0, UNKNOWN_REPLY_TOKENS)

    def mark_saved(self) -> None:
        self.saved = True

    def mark_unsaved(self) -> None:
        """Its save's commit failed after all: what it holds is on no disk."""
        self.saved = False

    def mark_canonical(self) -> None:
        """The slot now holds exactly its conversation's canonical prefix (canonical/prefix.py)."""
        if self.holding is not None:
            self.holding.canonical = True

    def take(self, serving: Sequence[str] | None = None) -> None:
        """Taken from the pool (`serving`: for the conversation of these keys)."""
        self.busy = True
        self.taken += 1
        self.serving = list(serving) if serving else None

    def give_back(self, used: bool) -> None:
        """Given back to the pool; `used`: by a request (LRU order is a request's)."""
        self.busy = False
        self.saving = False
        self.prefetching = False
        self.claimed = False
        self.serving = None
        self.finishing = False
        if used:
            self.last_used = time.monotonic()

    def claim(self) -> None:
        """Its own conversation's next turn waits for it during a background save."""
        self.claimed = True

    def hand_off(self) -> None:
        """Its request's reply is delivered; kvproxy's own work after it holds the slot."""
        self.finishing = True

    def seen_empty(self) -> None:
        """The server showed it holding no tokens: it belongs to no tenant."""
        self.occupant = NOBODY

    def ours_ended(self, prompt: int, generated: int) -> None:
        """Our request on the slot ended: trust what it left (as GET /slots right after it
        would) until that GET answers, sent without holding the slot."""
        self.seen_at = time.monotonic()
        self.pending = (prompt, prompt + generated)

    def shows_ours(self, info: SlotInfo) -> bool:
        """Does the server show the slot as our last use left it? Before the GET /slots after
        that use answered, the snapshot is not known: the slot must show a task other than
        the one last seen, and the tokens that use left."""
        if self.pending is None:
            return info.snapshot == self.snapshot
        low, high = self.pending
        n = info.n_prompt_tokens
        last_task = self.snapshot[0] if self.snapshot else None
        if n is None or not low <= n <= high:
            return False
        return last_task is None or info.id_task != last_task

    def shows_restart(self, info: SlotInfo) -> bool:
        """An older task than the newest one seen there (task ids only grow while a server
        runs), or none: the server started again since."""
        last, now = self.last_task, info.id_task
        return last is not None and (now is None or (isinstance(now, int) and now < last))

    def observe(self, info: SlotInfo, count_tokens: bool = False) -> None:
        """What GET /slots shows now is what our own last use left: later differences mean
        someone else used or wiped the slot. `count_tokens`: the holding's size is what the
        server reports (after our own request)."""
        self.snapshot = info.snapshot
        if isinstance(info.id_task, int) and info.id_task > (self.last_task or -1):
            self.last_task = info.id_task
        self.pending = None
        self.seen_at = time.monotonic()
        if count_tokens and self.holding is not None and info.n_prompt_tokens is not None:
            self.holding.n_tokens = info.n_prompt_tokens

    def evaluated(self, n_tokens: int, holding: Holding | None = None) -> None:
        """kvproxy's own evaluation (`n_predict: 0`) of `n_tokens` on the slot ended: it holds
        them under a task kvproxy has not seen, as after a request of ours (`ours_ended`), so
        no GET /slots is needed on the request's path to trust it. `holding`: what they are,
        when not what the slot held (an opening or a stem cut from it, a canonical rewrite),
        not on disk yet."""
        if holding is not None:
            self.hold(holding, saved=False)
        if self.holding is not None:
            self.holding.n_tokens = n_tokens
        self.ours_ended(n_tokens, 1)

    def restored(self, holding: Holding) -> None:
        """The slot now holds a restored state, also on disk. A restore leaves the slot's
        last task as it was; only the token count moves."""
        self.hold(holding, saved=True)
        if self.pending is not None:
            # The last task (kvproxy's own evaluation) is still not seen: a newer one than
            # the snapshot's, now showing the restored tokens.
            self.pending = (holding.n_tokens, holding.n_tokens)
            return
        prev_task = self.snapshot[0] if self.snapshot else None
        self.snapshot = (prev_task, holding.n_tokens if prev_task is not None else None)

    def admit(self, tenant: str | None) -> None:
        """The server's slot may hold `tenant`'s tokens from now on (see SlotWork.admit)."""
        self.occupant = tenant

    @contextlib.contextmanager
    def acting(self, action: str) -> Iterator[None]:
        """A save or restore of the slot is under way (the status page shows it)."""
        self.action = action
        try:
            yield
        finally:
            self.action = None

    def begin_prefetch(self, chain: Sequence[str]) -> None:
        """Taken for a prefetch of the conversation `chain`: its request waits for the slot
        (and claims it) rather than going elsewhere."""
        self.prefetching = True
        self.serving = list(chain)

    def begin_background_save(self) -> None:
        """Taken for a background save: a request may wait for it rather than evict another."""
        self.saving = True

    def started_again(self) -> None:
        """The server was seen to start again: its task ids begin anew."""
        self.last_task = None

    def mark_started(self) -> None:
        """kvproxy gives the slot a task of its own (a server that wipes idle slots may wipe
        every other idle slot now)."""
        self.started_at = time.monotonic()
