"""Tokenising texts that share a long head: the head once, each short tail apart, stitched
where the server's tokeniser provably starts afresh. The result is what tokenising each text
in full gives; whenever a check below fails, each text is tokenised in full.

The canonical prefix (canonical.py) tokenises a few renders of one conversation that differ
only after its last message or two, so tokenising each in full repeats thousands of tokens.

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
from collections.abc import Sequence
from dataclasses import dataclass

from .llama import LlamaClient
from .upstream import UpstreamError

# Characters each side of the boundary that check 4 tokenises: longer than
# any special token's text in the vocabularies llama.cpp ships.
GUARD = 48

# An angle-bracket tag without whitespace or inner brackets (check 2 holds by its shape).
_MARKER = re.compile(r"<[^<>\s]{1,62}>")


# Distinct markers, the last ones in the shared text, that are probed as special tokens.
PROBED = 4


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


async def tokenize_all(client: LlamaClient, texts: Sequence[str]) -> list[list[int]]:
    """The same tokens as `tokenize_each`, tokenising the shared head only once when a safe
    boundary is found and proven."""
    found = candidates(texts) if len(texts) > 1 else []
    if found:
        try:
            stitched = await _stitched(client, found, texts)
        except UpstreamError:
            stitched = None  # a probe refused: the full path says whether the server can
        if stitched is not None:
            return stitched
    return await tokenize_each(client, texts)


async def special_markers(client: LlamaClient, markers: Sequence[str]) -> dict[str, int]:
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


async def _stitched(
    client: LlamaClient, found: Sequence[Boundary], texts: Sequence[str]
) -> list[list[int]] | None:
    special = await special_markers(client, [b.marker for b in found])
    plan = next((b for b in found if b.marker in special), None)
    if plan is None:
        return None
    # All at once: the checks cost a millisecond beside the head, and are wasted only when
    # one fails.
    n = len(texts)
    head, wrap, before, *rest = await asyncio.gather(
        client.tokenize(texts[0][: plan.at]),
        client.tokenize("", add_special=True),
        client.tokenize(plan.before, add_special=False),
        *(client.tokenize(t[plan.at :], add_special=False) for t in texts),
        *(client.tokenize(after, add_special=False) for after in plan.after),
        *(client.tokenize(plan.before + after, add_special=False) for after in plan.after),
    )
    tails, afters, wholes = rest[:n], rest[n : 2 * n], rest[2 * n :]
    if any(whole != before + after for whole, after in zip(wholes, afters, strict=True)):
        return None
    parts = split_head(head, special[plan.marker], wrap)
    if parts is None:
        return None
    body, trailer = parts
    return [body + tail + trailer for tail in tails]
