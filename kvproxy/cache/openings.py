"""Openings: the shared start of a namespace's conversations, kept as an entry of its own.

Different sessions of one agent start with the same messages (OpenClaw's and Claude Code's
~10k-token system prompt). A state restored from disk only serves what its model class
allows (policy.restore_serves): on sliding-window models a divergence near its end, on
recurrent and hybrid ones an exact extension. So a new session sharing only the system
prompt with a stored conversation would start cold. An opening entry ends exactly where the
shared part ends: every new session extends it, on every model class.

Which boundaries are openings is observed: a request that matches a known conversation
(resident or stored) only partially, at key depth d >= 1, shows that d is shared. A leading
system message of ~1k tokens or more (d = 1) is presumed to be one before anything is seen.
The entry is made from a live slot only (a restored SWA or recurrent state cannot be cut
back), in `prepare`, at three points:

- a request starting cold that passes through a wanted opening (`prefill`): the opening's
  canonical tokens are evaluated first (`/completion`, `n_predict: 0`) and saved; the request
  then extends them on the live slot. Cost: one save of the opening, no extra prefill. This
  is where an agent's first session leaves its system prompt. The same when the request
  starts from a restored opening shorter than one it passes through (Codex: the second
  session restores the instructions and shows the context message after them is shared too).
- a new session or branch landing on the live slot of a conversation it parts from
  (after that conversation's own save): the slot is cut back to the opening (the server
  keeps the common prefix, evaluates nothing) and saved; the request is served from it.
- a slot about to be given to another conversation (after its own save), cut and saved the
  same way. Not on recurrent and hybrid models: cutting back a live state there
  re-evaluates the opening (no checkpoint), which an unrelated request should not pay.

Each costs two /apply-template and two /tokenize calls and the save, once per opening while
its entry lives (then it exists and nothing is done; openings that could not be made are
not retried). Measured on the bundled Gemma 3 270M: see tests/test_real_openings.py.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from kvproxy.cache.bounds import NamespaceLRU
from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.context import CacheContext
from kvproxy.cache.habits import worth_comparing
from kvproxy.cache.policy import (
    ReuseRule,
    StoredView,
    near_end_candidate,
    pick_stored,
    resident_serves,
    reuse_rule,
    window_serves,
)
from kvproxy.cache.saving import SavesUnderWay
from kvproxy.cache.slotio import SlotWork
from kvproxy.cache.slots import Holding, Slot, SlotPool
from kvproxy.cache.stems import Stems
from kvproxy.http.session import UpstreamError
from kvproxy.store import Entry
from kvproxy.wire import Conversation

log = logging.getLogger("kvproxy.cache")

# Openings remembered per namespace (the most recently seen win).
MAX_PER_NAMESPACE = 4
SYSTEM_ROLES = ("system", "developer")
# A leading system message of at least this many characters (~1k tokens) is presumed to be
# an opening before any other session is seen: an agent's, worth one more save.
PRESUMED_MIN_CHARS = 4000


@dataclass(frozen=True)
class Found:
    """What the store holds for a request: the entry the server will reuse most (by the
    model class's rule) and the entry sharing the most boundaries with it, each with the
    boundaries it shares."""

    best: tuple[Entry, int] | None
    longest: tuple[Entry, int] | None
    stem: bool = False  # `best` is the stem of the request's system message (stems.py)


NOTHING_FOUND = Found(None, None)


class Openings:
    def __init__(self, ctx: CacheContext, work: SlotWork) -> None:
        self.backend = ctx.backend
        self.store = ctx.store
        self.settings = ctx.settings
        self.guard = ctx.guard
        self.work = work
        self._seen: dict[str, dict[str, int]] = {}  # namespace -> {opening key: depth}
        self.kept = NamespaceLRU()  # which namespaces' openings are remembered (bounds.py)
        self._failed: dict[str, None] = {}  # opening keys that could not be made (bounded)
        self.stems = Stems(ctx, work)  # the heads of system messages before what changes
        self.making = SavesUnderWay()  # openings a request is evaluating now, by key

    # --- the model class's rule

    def rule(self) -> ReuseRule:
        info = self.backend.model_info
        if info is None:
            return reuse_rule("unknown")
        return reuse_rule(info.model_class, info.n_swa)

    def resident_depth(self, slot: Slot, conv: Conversation) -> int:
        """How deep the slot holds the request, 0 when what it holds came from disk and
        cannot serve where the request parts from it."""
        shared = slot.shared_depth(conv.keys, conv.namespace)
        held = slot.holding
        if shared == 0 or held is None:
            return 0
        return (
            shared
            if resident_serves(self.rule(), shared, held.restored_depth, held.n_tokens)
            else 0
        )

    async def find(self, conv: Conversation) -> Found:
        """The stored entries for the request, in one index query (and a second only when
        the entry found expired since housekeeping last applied the TTL)."""
        if not self.backend.loras.current(conv.namespace):
            return NOTHING_FOUND  # read before the server was seen to start again
        await self.work.saves_done(conv.keys)
        found = self.restorables(await self.store.candidates_async(conv.keys, conv.namespace))
        best = await self._pick(conv, found)
        if best is not None and self.store.expired(best[0]):
            # A full eviction pass costs O(entries): housekeeping runs it every second, and
            # an entry that expired since is not restored either.
            await self.work.evict()
            found = await self.store.candidates_async(conv.keys, conv.namespace)
            found = self.restorables(found)
            best = await self._pick(conv, found)
        # candidates() puts the longest match first.
        longest = found[0] if found else None
        if best is None:
            stem = await self.stems.find(conv)
            if stem is not None and self.restorable(stem):
                return Found((stem, 0), longest, stem=True)
        return Found(best, longest)

    def older(self, entry: Entry) -> bool:
        """Saved before the server's current start (by another server life)."""
        return entry.created < self.backend.life_started

    def restorable(self, entry: Entry) -> bool:
        """Not set aside by the restore guard for the server's current start."""
        life = self.backend.life
        return self.guard.allows(life, entry.namespace, entry.key, self.older(entry))

    def restorables(self, found: list[tuple[Entry, int]]) -> list[tuple[Entry, int]]:
        return [(entry, shared) for entry, shared in found if self.restorable(entry)]

    async def _pick(
        self, conv: Conversation, found: list[tuple[Entry, int]]
    ) -> tuple[Entry, int] | None:
        """The stored entry the server will reuse most for the request, by the model class's
        rule (not merely the longest key match), and the boundaries it shares."""
        rule = self.rule()
        views = [StoredView(len(e.chain) or 1, shared, e.n_tokens) for e, shared in found]
        i = pick_stored(rule, len(conv.keys), views)
        j = near_end_candidate(rule, views, i)
        if j is not None:
            # A sliding-window state parted from near its end (the first turn after a client
            # rewrote its last one, before its habit was known): it may still serve more.
            before = await self._tokens_before(conv, views[j].shared)
            if before is not None and window_serves(rule, views[j], before):
                if i is None or before > views[i].n_tokens:
                    return found[j]
        return None if i is None else found[i]

    async def _tokens_before(self, conv: Conversation, depth: int) -> int | None:
        """How many tokens of the request come before its message `depth`, as the server
        tokenises them (None when it cannot say)."""
        try:
            tokens = await canonical.prefix_tokens(
                self.work.client, conv.template, conv.messages[:depth], canonical.VERBATIM
            )
        except (UpstreamError, ValueError) as exc:
            log.debug("cannot count the tokens before message %d: %s", depth, exc)
            return None
        return len(tokens) if tokens else None

    # --- which boundaries are openings

    def observe(self, conv: Conversation, pool: SlotPool, stored: tuple[Entry, int] | None) -> None:
        """Note the depth at which the request parts from the known conversation it shares
        most with (resident, or `stored`: `Found.longest`), when it does not extend it."""
        best, extends, depth = 0, False, 0
        for slot in pool.holding_namespace(conv.namespace):
            held = slot.holding
            assert held is not None
            shared = slot.shared_depth(conv.keys, conv.namespace)
            if shared > best or (shared == best and shared == len(held.chain)):
                best, extends, depth = shared, shared == len(held.chain), len(held.chain)
        if stored is not None:
            entry, shared = stored
            if shared > best or (shared == best and shared == len(entry.chain)):
                best, extends, depth = shared, shared == len(entry.chain), len(entry.chain)
        if worth_comparing(depth, len(conv.keys), best):
            return  # parts near the end, going on: a client's rewrite (habits.py), no branch
        if best and not extends and best < len(conv.keys):
            self._note(conv.namespace, conv.keys[best - 1], best, conv.tenant)

    def _note(self, namespace: str, key: str, depth: int, tenant: str | None = None) -> None:
        for gone in self.kept.add(namespace, tenant):
            self._seen.pop(gone, None)
        seen = self._seen.setdefault(namespace, {})
        seen.pop(key, None)
        seen[key] = depth
        while len(seen) > MAX_PER_NAMESPACE:
            del seen[next(iter(seen))]

    async def wanted(self, holding: Holding) -> int:
        """The deepest opening the holding passes through that has no entry yet (0: none)."""
        seen = self._seen.get(holding.namespace, {})
        self.kept.touch(holding.namespace)
        depths = [
            d for k, d in seen.items() if d < len(holding.chain) and holding.chain[d - 1] == k
        ]
        if len(holding.chain) > 1 and _long_system(holding.messages[:1]) and self._presumes():
            depths.append(1)
        for depth in sorted(set(depths), reverse=True):
            key = holding.chain[depth - 1]
            if key not in self._failed and not await self.store.contains_async(key):
                return depth
        return 0

    def _presumes(self) -> bool:
        """Whether a long system prompt is an opening before any session shared it. Not on a
        model with full attention: there a stored conversation serves a new session's system
        prompt by its common prefix, and an opening would be the same tokens on disk again
        (12 MB for 1.5k tokens on the bundled model) for no request."""
        info = self.backend.model_info
        return info is None or info.model_class != "dense"

    # --- making the entry

    async def before_reassign(self, slot: Slot, conv: Conversation) -> None:
        """The slot (ours, verified, its own content saved if worth it) is about to hold
        `conv`: first leave an opening entry from what it holds, when one is wanted. For a
        new session sharing the opening this also leaves the slot holding exactly it."""
        held = slot.holding
        if held is None or not self.backend.disk_enabled:
            return
        depth = await self.wanted(held)
        if depth == 0:
            return
        incoming = slot.shared_depth(conv.keys, conv.namespace)
        rule = self.rule()
        if rule.rule == "extension" and incoming < depth:
            return  # cutting back would re-evaluate the opening for a request that needs none
        if not resident_serves(rule, depth, held.restored_depth, held.n_tokens):
            return  # a restored state that cannot be cut back
        if await self.make(slot, depth) is None:
            self._failed[held.chain[depth - 1]] = None
            while len(self._failed) > 1024:
                del self._failed[next(iter(self._failed))]

    async def prefill_depth(self, conv: Conversation, start: int = 0) -> int:
        """The wanted opening deeper than its first `start` boundaries (those the slot holds
        for it; 0: cold) that a request about to run passes through (0: none)."""
        if not self.backend.disk_enabled or len(conv.keys) < 2:
            return 0
        depth = await self.wanted(self._incoming(conv))
        return depth if depth > start else 0

    async def prefill(self, slot: Slot, conv: Conversation, depth: int, start: int = 0) -> int:
        """Evaluate the request up to its opening at `depth` (prefill_depth) on `slot` (ours,
        verified, its content saved if worth it) and save it; the request then extends it on
        the live slot, so this costs it one save, no prefill. Returns the tokens evaluated
        (the server counts them in the request's cache_n)."""
        held = self._incoming(conv)
        before = slot.holding
        # What the slot held is on disk (or not worth keeping); from `start` on it is this
        # request's (hold keeps the restored part's depth).
        slot.hold(held, saved=True)
        evaluated = await self.make(slot, depth)
        if evaluated is None:
            self._failed[conv.keys[depth - 1]] = None
            if slot.holding is held and before is not None and start:
                slot.hold(before, saved=True)  # nothing was evaluated: it holds what it did
            elif slot.holding is held:
                slot.forget()
            return 0
        return evaluated

    def _incoming(self, conv: Conversation) -> Holding:
        held = Holding(conv.namespace, list(conv.keys), 0, len(conv.messages), conv.messages)
        held.template = dict(conv.template)
        held.n_tokens = 1 << 62  # not known before the prompt is tokenised; no bound
        return held

    async def make(self, slot: Slot, depth: int) -> int | None:
        """Make the slot hold the opening at `depth` and save it: the tokens the server
        evaluated for it, or None when it was not made."""
        held = slot.holding
        assert held is not None
        messages = held.messages[:depth]
        if len(messages) < depth:
            return False
        try:
            tokens = await canonical.prefix_tokens(
                self.work.client, held.template, messages, canonical.VERBATIM, self.work.heads
            )
        except (UpstreamError, ValueError) as exc:
            log.debug("no opening for %s: %s", held.key[:12], exc)
            return None
        if not tokens or len(tokens) < self.settings.min_tokens or len(tokens) > held.n_tokens:
            return None
        opening = Holding(
            held.namespace,
            held.chain[:depth],
            len(tokens),
            depth,
            list(messages),
            dict(held.template),
            canonical=True,
        )
        return await self.work.save_cut(slot, tokens, opening, f"opening of {depth} messages")


def _long_system(messages: list[object]) -> bool:
    """A leading system message long enough to be presumed an opening (an agent's)."""
    first = messages[0] if messages else None
    if not isinstance(first, Mapping) or first.get("role") not in SYSTEM_ROLES:
        return False
    content = first.get("content")
    if isinstance(content, list):
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return isinstance(content, str) and len(content) >= PRESUMED_MIN_CHARS
