"""Stems: the start of a long system prompt up to the first text that changes between
sessions (a date, a time, a session id), kept as an entry of its own.

OpenClaw writes `Current date: 2026-12-01` into its ~10k-token system prompt ~1,300 tokens
before its end. At midnight every new session's system message differs from every stored one,
so no key is shared, and on a sliding-window, recurrent or hybrid model nothing stored could
serve the new session anyway (a restored state serves only what extends it, or parts near its
end). A stem entry ends just before the text that changes: every session with the same head
extends it exactly, on every model class, and the date change costs only the tail.

Where a stem ends (a cut, in characters of the leading system message) is presumed where the
text shows a date or time, and learnt where requests were seen to part inside a long system
message from the closest known conversation (the miss explanation). A cut is the start of the
word that changes, wherever it stands (on a line of its own or inside a sentence: `… reports.
Current date: 2026-12-03. The crews …`). Its key hashes the namespace, the role and the text
before the cut; its tokens are where the renders part at the token level: the common prefix
of two renders of the message's start that differ only in that word's letters and digits
(the text as it is, and the word with each letter and digit moved on by one), as another day's
text differs. A tokeniser may join the cut's last characters to the word after it (a space, a
colon): the tokens end before any such join, so every text that differs there extends them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from typing import Any

from kvproxy import keys
from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.canonical.tokensplit import tokenize_all
from kvproxy.cache.context import CacheContext
from kvproxy.cache.servers.slots import Holding, Slot
from kvproxy.cache.slotio.slotwork import SlotWork
from kvproxy.http.session import UpstreamError
from kvproxy.store import Entry
from kvproxy.wire import Conversation

log = logging.getLogger("kvproxy.cache")

# A stem shorter than this (characters, ~500 tokens) is not worth its save.
MIN_STEM_CHARS = 2000
# Cut points remembered per namespace (the most recently seen win).
MAX_CUTS = 4
SYSTEM_ROLES = ("system", "developer")
# Text that changes from one session or day to the next.
VOLATILE = re.compile(
    r"\b\d{4}-\d{2}-\d{2}\b"  # 2026-12-01
    r"|\b\d{1,2}:\d{2}(:\d{2})?\b"  # 14:05, 14:05:09
    r"|\b[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\b"  # a uuid
    r"|\b(Mon|Tues|Wednes|Thurs|Fri|Satur|Sun)day\b"
    r"|\b(January|February|March|April|May|June|July|August|September|October|November"
    r"|December) \d{1,2}\b",
    re.IGNORECASE,
)


def system_text(messages: Sequence[Any]) -> str | None:
    """The leading system message's text, when it is plain text."""
    first = messages[0] if messages else None
    if not isinstance(first, Mapping) or first.get("role") not in SYSTEM_ROLES:
        return None
    content = first.get("content")
    return content if isinstance(content, str) else None


# Characters of the text after a cut that its probes render (the changing word and a little
# after it; what follows does not move where the two renders part).
PROBE_TAIL_CHARS = 64


def word_start(text: str, at: int) -> int:
    """The start of the whitespace-delimited word holding character `at`."""
    while at > 0 and not text[at - 1].isspace():
        at -= 1
    return at


def presumed_cut(text: str) -> int | None:
    """The start of the first date, time or id with enough text before it."""
    for found in VOLATILE.finditer(text):
        if found.start() >= MIN_STEM_CHARS:
            return found.start()
    return None


def stem_key(namespace: str, messages: Sequence[Any], cut: int) -> str | None:
    """The key of the stem of `messages` ending at character `cut` of the system message."""
    text = system_text(messages)
    if text is None or len(text) <= cut:
        return None
    role = str(messages[0]["role"])
    return keys.stem(namespace, role, text[:cut])


def moved_on(text: str) -> str:
    """`text` with each ASCII letter and digit of its first word moved on by one (a to b, z to
    a, 9 to 0): the same shape of word, another value, and a different first character."""
    out = []
    word = True
    for i, ch in enumerate(text):
        if ch.isspace() and i > 0:
            word = False
        if word and ch.isascii() and ch.isalnum():
            base, span = ("0", 10) if ch.isdigit() else ("a" if ch.islower() else "A", 26)
            ch = chr(ord(base) + (ord(ch) - ord(base) + 1) % span)
        out.append(ch)
    return "".join(out)


def stem_probes(messages: Sequence[Any], cut: int) -> list[list[dict[str, Any]]]:
    """Two one-message conversations that part right at the cut, as two days' texts do: the
    common prefix of their tokens is the stem's."""
    text = system_text(messages)
    assert text is not None
    role = str(messages[0]["role"])
    tail = text[cut : cut + PROBE_TAIL_CHARS]
    other = moved_on(tail)
    tails = (tail, other) if other[:1] != tail[:1] else ("A", "Zebra, 42?")
    return [[{"role": role, "content": text[:cut] + t}] for t in tails]


class Cuts:
    """Each namespace's cut points: presumed from the text, and learnt from partings."""

    def __init__(self) -> None:
        self._learnt: dict[str, dict[int, None]] = {}

    def of(self, namespace: str, messages: Sequence[Any]) -> list[int]:
        """Where the request's system message may have a stem, deepest first."""
        text = system_text(messages)
        if text is None or len(text) < MIN_STEM_CHARS:
            return []
        cuts = set(self._learnt.get(namespace, {}))
        presumed = presumed_cut(text)
        if presumed is not None:
            cuts.add(presumed)
        return sorted((c for c in cuts if MIN_STEM_CHARS <= c < len(text)), reverse=True)

    def learn(self, namespace: str, messages: Sequence[Any], index: int, offset: int) -> None:
        """A request parted from the closest known conversation in message `index` at
        character `offset`: inside a long system message, the word there starts what changes
        between sessions (a stem ends before it)."""
        text = system_text(messages)
        if index != 0 or text is None or offset >= len(text):
            return
        cut = word_start(text, offset)
        if cut < MIN_STEM_CHARS:
            return
        seen = self._learnt.setdefault(namespace, {})
        seen.pop(cut, None)
        seen[cut] = None
        while len(seen) > MAX_CUTS:
            del seen[next(iter(seen))]


class Stems:
    """Finding, and making, the stems of requests' system messages (see the module doc)."""

    def __init__(self, ctx: CacheContext, work: SlotWork) -> None:
        self.backend = ctx.backend
        self.store = ctx.store
        self.settings = ctx.settings
        self.work = work
        self.cuts = Cuts()
        self._failed: dict[str, None] = {}  # stem keys that could not be made (bounded)

    async def find(self, conv: Conversation) -> Entry | None:
        """The deepest stored stem the request extends."""
        for _cut, key in self._stems(conv):
            found = await self.store.candidates_async([key], conv.namespace)
            if found and not self.store.expired(found[0][0]):
                return found[0][0]
        return None

    def _stems(self, conv: Conversation) -> list[tuple[int, str]]:
        """The request's possible stems, deepest first: (cut, key)."""
        out = []
        for cut in self.cuts.of(conv.namespace, conv.messages):
            key = stem_key(conv.namespace, conv.messages, cut)
            if key is not None:
                out.append((cut, key))
        return out

    async def wanted(self, conv: Conversation) -> tuple[int, str] | None:
        """The deepest stem of the request's system message with no entry yet."""
        if not self.backend.disk_enabled:
            return None
        for cut, key in self._stems(conv):
            if key in self._failed:
                continue
            if await self.store.contains_async(key):
                return None  # a deeper one exists: the shallower ones are not needed
            return cut, key
        return None

    async def make(self, slot: Slot, conv: Conversation, cut: int, key: str) -> int:
        """Evaluate the request's stem on `slot` (ours, verified, its content saved if worth
        it) and save it: the tokens evaluated (the request then extends them)."""
        tokens = None
        try:
            client = self.work.client
            probes = stem_probes(conv.messages, cut)
            renders = [await canonical.render(client, conv.template, m) for m in probes]
            prompts = [r for r in renders if r is not None]
            if len(set(prompts)) == len(probes):
                lists = await tokenize_all(client, prompts, self.work.heads)
                tokens = canonical.common_prefix(lists)
        except (UpstreamError, ValueError) as exc:
            log.debug("no stem for %s: %s", key[:12], exc)
        if not tokens or len(tokens) < self.settings.min_tokens:
            self._fail(key)
            return 0
        stem = Holding(
            conv.namespace, [key], len(tokens), 0, [], dict(conv.template), canonical=True
        )
        evaluated = await self.work.save_cut(slot, tokens, stem, f"stem of {cut} characters")
        if evaluated is None:
            self._fail(key)
        return evaluated or 0

    def _fail(self, key: str) -> None:
        self._failed[key] = None
        while len(self._failed) > 1024:
            del self._failed[next(iter(self._failed))]
