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

from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.context import CacheContext
from kvproxy.cache.decisions.bounds import NamespaceLRU
from kvproxy.cache.decisions.policy import resident_serves
from kvproxy.cache.disk.saving import SavesUnderWay
from kvproxy.cache.habits import worth_comparing
from kvproxy.cache.prefixes.reuse import Reuse
from kvproxy.cache.servers.slotpool import SlotPool
from kvproxy.cache.servers.slots import Holding, Slot
from kvproxy.cache.slotio.slotwork import SlotWork
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


class Openings:
    def __init__(self, ctx: CacheContext, work: SlotWork, reuse: Reuse) -> None:
        self.backend = ctx.backend
        self.store = ctx.store
        self.settings = ctx.settings
        self.work = work
        self._seen: dict[str, dict[str, int]] = {}  # namespace -> {opening key: depth}
        # Which namespaces' openings are remembered (cache/decisions/bounds.py).
        self.kept = NamespaceLRU()
        self._failed: dict[str, None] = {}  # opening keys that could not be made (bounded)
        self.reuse = reuse  # what the server reuses of a slot or a stored state
        self.making = SavesUnderWay()  # openings a request is evaluating now, by key

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
        rule = self.reuse.rule()
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
