"""Tokenising texts that share a long head: the head once, each short tail apart, stitched
where the server's tokeniser provably starts afresh. The result is what tokenising each text
in full gives; whenever a check below fails, each text is tokenised in full.

The canonical prefix (prefix.py) tokenises a few renders of one conversation that differ
only after its last message or two, so tokenising each in full repeats thousands of tokens;
and a conversation's next save renders the same text again plus a turn or two. So the head
is tokenised once per save, and `Heads` keeps the last heads so that a later save tokenises
only the text after the head its conversation's previous save ended at (checked again there).

Why a boundary is safe, from llama.cpp's src/llama-vocab.cpp (`tokenizer_st_partition`,
`impl::tokenize`) and tools/server's `/tokenize` (`tokenize_mixed` → `common_tokenize` with
the request's add_special and parse_special):

- With parse_special, special tokens (control, user-defined, unknown) are cut out of the text
  first, longest text first, each left to right; every raw-text fragment between them is then
  tokenised on its own. A position right after a special token's occurrence ends a fragment.
- SPM with add_space_prefix puts a space before the text's first fragment and before every
  fragment after a special token: a tail tokenised alone gets the space the whole text gives.
- A special token with the RSTRIP attribute eats the whitespace after it (phi-3 has it on all
  of them), LSTRIP the whitespace before it: the tail must not start with whitespace, and
  the head ends with the token itself.
- add_special puts BOS in front (and EOS at the end with add_eos, CLS/SEP for WPM): the head
  keeps its leading ones, its trailing ones (the end of `tokenize("")`) move to the end.

So the boundary is right after a marker M, an angle-bracket tag of the template
(`<start_of_turn>`, `<|im_start|>`), where:

1. the server reads M as one token with parse_special and as something else without: M is
   the whole text of a control token (M holds no whitespace, so no strip shortened it);
2. M cannot overlap itself (`<` only first, `>` only last): the occurrence is not the tail
   of an earlier one;
3. the next character is not whitespace;
4. around the boundary (GUARD characters each side, in each text) the text tokenises as a
   whole exactly as its two halves do: no longer special token spans the boundary, and the
   tokeniser treats a fragment after a special token as it treats a text's first one.
"""

from __future__ import annotations

import asyncio
import re
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvproxy.http.session import UpstreamError
from kvproxy.server.api import LlamaClient

# Characters each side of the boundary that check 4 tokenises: longer than
# any special token's text in the vocabularies llama.cpp ships.
GUARD = 48

# An angle-bracket tag without whitespace or inner brackets (check 2 holds by its shape).
_MARKER = re.compile(r"<[^<>\s]{1,62}>")


# Distinct markers, the last ones in the shared text, that are probed as special tokens.
PROBED = 4

# Calls in flight at once. llama-server serves HTTP on a fixed pool of threads (n_parallel + 2
# by default, tools/server), each holding its keep-alive connection: a burst of a dozen
# connections got some answered "Server disconnected" (kvproxy bench canonical, 1 slot).
# Two is what tokenising two renders in full asked for.
IN_FLIGHT = 2


class Tokenizer(Protocol):
    async def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]: ...


class _Bounded:
    """A client's tokenize with at most `limit` calls in flight."""

    def __init__(self, client: Tokenizer, limit: int = IN_FLIGHT) -> None:
        self.client = client
        self._slots = asyncio.Semaphore(limit)

    async def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        async with self._slots:
            return await self.client.tokenize(text, add_special, parse_special)


@dataclass(frozen=True)
class Boundary:
    at: int  # offset where the tails start
    marker: str  # the tag that ends right there
    before: str  # shared text before `at` that check 4 tokenises (the marker included)
    after: list[str]  # each text's next characters after `at`, that check 4 tokenises


def candidates(texts: Sequence[str], guard: int = GUARD) -> list[Boundary]:
    """Boundaries within the texts' shared start that checks 2 and 3 allow, the last first,
    down to the last occurrence of the PROBED-th distinct marker."""
    first = texts[0]
    shared = common_start(texts)
    found: list[Boundary] = []
    markers: set[str] = set()
    for match in reversed(list(_MARKER.finditer(first, 0, shared))):
        at = match.end()
        # Python's isspace covers C's isspace (and more: the safe side).
        if not all(len(t) > at and not t[at].isspace() for t in texts):
            continue
        if match.group() not in markers and len(markers) == PROBED:
            break
        markers.add(match.group())
        before = first[max(0, match.start() - guard) : at]
        found.append(Boundary(at, match.group(), before, [t[at : at + guard] for t in texts]))
    return found


def common_start(texts: Sequence[str]) -> int:
    """How many leading characters all texts share (a binary search of C-speed compares:
    the renders run to tens of thousands of characters)."""
    first = texts[0]
    lo, hi = 0, min(len(t) for t in texts)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if all(t.startswith(first[:mid]) for t in texts[1:]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def split_head(head: list[int], marker: int, wrap: list[int]) -> tuple[list[int], list[int]] | None:
    """`head`: the head's tokens with add_special, which end with the marker's token and then
    the trailing part of `wrap` (`tokenize("")` with add_special). Returns the tokens before
    that trailing part and the part itself, or None when they cannot be told apart."""
    if marker in wrap:
        return None
    for k in range(len(wrap) + 1):
        end = len(head) - k
        if end >= 1 and head[end - 1] == marker and head[end:] == wrap[len(wrap) - k :]:
            return head[:end], head[end:]
    return None


async def tokenize_each(client: LlamaClient, texts: Sequence[str]) -> list[list[int]]:
    """Every text tokenised in full (add_special, parse_special), as the server does prompts."""
    return list(await asyncio.gather(*(client.tokenize(t) for t in texts)))


async def tokenize_all(
    client: LlamaClient, texts: Sequence[str], heads: Heads | None = None
) -> list[list[int]]:
    """The same tokens as `tokenize_each`, tokenising the shared head only once when a safe
    boundary is found and proven, and only its new part when `heads` knows its start."""
    found = candidates(texts) if len(texts) > 1 else []
    if found:
        try:
            stitched = await _stitched(_Bounded(client), found, texts, heads)
        except UpstreamError:
            stitched = None  # a probe refused: the full path says whether the server can
        if stitched is not None:
            return stitched
    return await tokenize_each(client, texts)


@dataclass(frozen=True)
class Head:
    """A head tokenised up to a proven boundary, that a later save may start from."""

    text: str
    marker: str  # the control token's text it ends with
    body: list[int]  # its tokens with add_special, the trailer left out; the marker's last
    trailer: list[int]  # what add_special puts at the end (EOS, SEP): mostly nothing
    wrap: list[int]  # `tokenize("")` with add_special, when it was tokenised
    before: str  # the window before the boundary (check 4) …
    before_tokens: list[int]  # … and its tokens: the same tokeniser gives the same ones


class Heads:
    """The last heads tokenised. A conversation's next save renders its text and more, so
    its head is the last one's plus the new turns: only those are tokenised. Owned by the
    app (one per llama-server); a few per live conversation at most."""

    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self._heads: OrderedDict[str, Head] = OrderedDict()
        # Markers the server read as plain text: not probed again, so a template whose tags
        # are no tokens of the model's (the bundled Gemma's ChatML) costs nothing extra.
        # Forgetting one (a model swap) only misses a speed-up.
        self.plain: set[str] = set()

    def learn_plain(self, markers: Sequence[str]) -> None:
        if len(self.plain) > 64:
            self.plain.clear()
        self.plain.update(markers)

    def longest(self, text: str, limit: int) -> Head | None:
        """The longest known head of at most `limit` characters that `text` starts with."""
        best: Head | None = None
        for head in self._heads.values():
            n = len(head.text)
            if n <= limit and (best is None or n > len(best.text)) and text.startswith(head.text):
                best = head
        return best

    def add(self, head: Head) -> None:
        self._heads[head.text] = head
        self._heads.move_to_end(head.text)
        while len(self._heads) > self.capacity:
            self._heads.popitem(last=False)

    async def tokenize_all(self, client: LlamaClient, texts: Sequence[str]) -> list[list[int]]:
        return await tokenize_all(client, texts, self)


async def special_markers(client: Tokenizer, markers: Sequence[str]) -> dict[str, int]:
    """Check 1: the markers the server reads as one token only with parse_special, each
    with that token."""
    distinct = list(dict.fromkeys(markers))
    answers = await asyncio.gather(
        *(
            client.tokenize(m, add_special=False, parse_special=p)
            for m in distinct
            for p in (True, False)
        )
    )
    special: dict[str, int] = {}
    for i, marker in enumerate(distinct):
        parsed, plain = answers[2 * i], answers[2 * i + 1]
        if len(parsed) == 1 and plain != parsed:
            special[marker] = parsed[0]
    return special


async def _none() -> list[int]:
    return []


@dataclass(frozen=True)
class _Attempt:
    """The calls for one boundary (and the known head, if any) and their answers."""

    plan: Boundary
    known: Head | None
    head: list[int]  # the head in full, or the part after the known head's seam
    before: list[int]
    known_checks: tuple[list[int], list[int], list[int]]  # its window: before, after, whole
    tails: list[list[int]]
    afters: list[list[int]]
    wholes: list[list[int]]


async def _attempt(
    client: Tokenizer, plan: Boundary, texts: Sequence[str], known: Head | None
) -> _Attempt:
    first = texts[0]
    at0 = len(known.text) if known is not None else 0
    after0 = first[at0 : min(at0 + GUARD, plan.at)]
    if known is None:
        head_call = client.tokenize(first[: plan.at])
    elif at0 < plan.at:
        head_call = client.tokenize(first[at0 : plan.at], add_special=False)
    else:
        head_call = _none()
    k_before = known.before if known is not None and after0 else ""
    n = len(texts)
    # All at once: the checks cost a millisecond beside the head.
    head, before, kb, ka, kw, *rest = await asyncio.gather(
        head_call,
        client.tokenize(plan.before, add_special=False),
        client.tokenize(k_before, add_special=False) if k_before else _none(),
        client.tokenize(after0, add_special=False) if k_before else _none(),
        client.tokenize(k_before + after0, add_special=False) if k_before else _none(),
        *(client.tokenize(t[plan.at :], add_special=False) for t in texts),
        *(client.tokenize(after, add_special=False) for after in plan.after),
        *(client.tokenize(plan.before + after, add_special=False) for after in plan.after),
    )
    return _Attempt(
        plan, known, head, before, (kb, ka, kw), rest[:n], rest[n : 2 * n], rest[2 * n :]
    )


async def _no_attempt() -> _Attempt | None:
    return None


async def _stitched(
    client: Tokenizer, found: Sequence[Boundary], texts: Sequence[str], heads: Heads | None
) -> list[list[int]] | None:
    if heads is not None:
        found = [b for b in found if b.marker not in heads.plain]
    if not found:
        return None
    first = texts[0]
    known = heads.longest(first, found[0].at) if heads is not None else None
    probed = list(dict.fromkeys([b.marker for b in found] + ([known.marker] if known else [])))
    # With heads, the last boundary's calls go with the probes (one round trip): its marker
    # is almost always the one proven, and a marker that is text is probed only once. With
    # none, a template of no control tokens would pay for a head in full on every call.
    special, wrap, speculated = await asyncio.gather(
        special_markers(client, probed),
        client.tokenize("", add_special=True),
        _attempt(client, found[0], texts, known) if heads is not None else _no_attempt(),
    )
    if heads is not None:
        heads.learn_plain([m for m in probed if m not in special])
    if speculated is not None and found[0].marker in special:
        attempt = speculated
    else:
        plan = next((b for b in found if b.marker in special), None)
        if plan is None:
            return None
        if plan is not found[0]:
            known = heads.longest(first, plan.at) if heads is not None else None
        attempt = await _attempt(client, plan, texts, known)
    stitched = _assemble(attempt, texts, special, wrap, heads)
    if stitched is None and attempt.known is not None:
        # The known head's seam did not hold in this text: the head in full.
        attempt = await _attempt(client, attempt.plan, texts, None)
        stitched = _assemble(attempt, texts, special, wrap, heads)
    return stitched


def _assemble(
    attempt: _Attempt,
    texts: Sequence[str],
    special: dict[str, int],
    wrap: list[int],
    heads: Heads | None,
) -> list[list[int]] | None:
    """Checks 4 and the head's shape on an attempt's answers; the tokens, or None."""
    plan, known, first = attempt.plan, attempt.known, texts[0]
    pairs = zip(attempt.wholes, attempt.afters, strict=True)
    if any(whole != attempt.before + after for whole, after in pairs):
        return None
    marker = special[plan.marker]
    if known is None:
        parts = split_head(attempt.head, marker, wrap)
        if parts is None:
            return None
        body, trailer = parts
    else:
        if not _still_valid(known, first, plan.at, special, wrap):
            return None
        kb, ka, kw = attempt.known_checks
        if known.before and len(known.text) < plan.at:
            if kb != known.before_tokens or kw != kb + ka:
                return None
        body, trailer = known.body + attempt.head, known.trailer
        if body[-1] != marker:
            return None
    if heads is not None:
        head = Head(first[: plan.at], plan.marker, body, trailer, wrap, plan.before, attempt.before)
        heads.add(head)
    return [body + tail + trailer for tail in attempt.tails]


def _still_valid(known: Head, text: str, at: int, special: dict[str, int], wrap: list[int]) -> bool:
    """Checks 1 and 3 for the known head's boundary in `text` (cut at `at`), and that the
    tokeniser still answers as it did (check 4 follows with the window's tokens)."""
    at0 = len(known.text)
    if at0 > at or special.get(known.marker) != known.body[-1] or wrap != known.wrap:
        return False
    return at0 == at or not text[at0].isspace()
