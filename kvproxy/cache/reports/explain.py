"""Explaining misses: where a request parted from the closest conversation the cache knew.

A prefix cache is defeated by anything that changes early in every request: a timestamp or
a request id an agent writes into its system prompt each turn makes every turn a miss. When
a request misses, this finds the known conversation (resident in a slot or stored on disk,
same namespace only, so never another tenant's) that shares the longest beginning with it,
and says where they part: the message index, the character offset in that message's text,
and a short excerpt of both sides.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import orjson

from kvproxy.cache.reports.events import MissExplanation
from kvproxy.keys import UnkeyableRequest, message_bytes
from kvproxy.server.modelinfo import ModelInfo
from kvproxy.store import Store

log = logging.getLogger("kvproxy.cache")

# Below this much shared text in the first message, two conversations are unrelated and a
# "divergence" would be noise ("You are" vs "You will").
MIN_SHARED_CHARS = 32
EXCERPT = 30  # characters on each side of the divergence point
MARK = "‖"  # where the two texts part, in excerpts


def explain_miss(
    messages: list[Any], candidates: Iterable[tuple[str, list[Any]]]
) -> MissExplanation | None:
    """`candidates`: (where, messages) of known conversations in the same namespace.

    The candidate that got furthest (message index, then character offset) wins. None when
    no candidate shares at least one whole message or MIN_SHARED_CHARS of the first, and when
    the request and the candidate agree wherever both have messages (one extends the other:
    nothing diverged)."""
    best: tuple[int, int, str, str, str] | None = None
    for where, theirs in candidates:
        try:
            found = _divergence(messages, theirs)
        except (UnkeyableRequest, TypeError, ValueError):
            continue  # a malformed stored conversation explains nothing
        if found is None:
            continue
        index, offset, ours_text, theirs_text = found
        if index == 0 and offset < MIN_SHARED_CHARS:
            continue
        if best is None or (index, offset) > (best[0], best[1]):
            best = (index, offset, ours_text, theirs_text, where)
    if best is None:
        return None
    index, offset, ours_text, theirs_text, where = best
    return MissExplanation(
        message_index=index,
        char_offset=offset,
        ours=excerpt(ours_text, offset),
        theirs=excerpt(theirs_text, offset),
        where=where,
    )


def _divergence(ours: list[Any], theirs: list[Any]) -> tuple[int, int, str, str] | None:
    """(message index, char offset, our text, their text) of the first difference."""
    for index, (mine, other) in enumerate(zip(ours, theirs, strict=False)):
        # Equal as keys see them (whitespace at the ends, null vs "", argument spacing…):
        # such differences never cause a miss, so they are not the explanation.
        if message_bytes(mine) == message_bytes(other):
            continue
        mine_text, other_text = _texts(mine, other)
        return index, _first_difference(mine_text, other_text), mine_text, other_text
    return None


def _texts(mine: Any, other: Any) -> tuple[str, str]:
    """The texts to compare: the contents when they differ (as the client wrote them when
    they are strings), else a canonical JSON rendering of the whole message (role, name,
    tool calls…)."""
    a, b = mine.get("content"), other.get("content")
    if _content_text(a) != _content_text(b):
        return _content_text(a), _content_text(b)
    return _render(mine), _render(other)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, Mapping) and p.get("type") == "text" for p in content
    ):
        return "\n".join(str(p.get("text", "")) for p in content)
    return orjson.dumps(content, option=orjson.OPT_SORT_KEYS).decode()


def _render(message: Mapping[str, Any]) -> str:
    return message_bytes(message).decode()


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def excerpt(text: str, offset: int, width: int = EXCERPT) -> str:
    """`width` characters either side of `offset`, the divergence point marked, control
    characters escaped so the excerpt stays on one log line."""
    start, end = max(0, offset - width), min(len(text), offset + width)
    before = ("…" if start > 0 else "") + _escape(text[start:offset])
    after = _escape(text[offset:end]) + ("…" if end < len(text) else "")
    return before + MARK + after


def _escape(text: str) -> str:
    out = []
    for ch in text:
        if ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ch == "\r":
            out.append("\\r")
        elif ch == "\\":
            out.append("\\\\")
        elif ord(ch) < 0x20 or 0x7F <= ord(ch) < 0xA0 or ch in "\u2028\u2029":
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def why_weak(
    restored: bool,
    info: ModelInfo | None,
    messages: list[Any],
    held: tuple[str, list[Any]] | None,
) -> str | MissExplanation:
    """Why a resident or restored request reused less than half of what it expected: where
    it parted from what the slot held when that is known, else the likely cause. `held`:
    the slot's name and what it held before the reply's bookkeeping replaced it."""
    if restored:
        if info is not None and info.has_swa:
            return (
                "a sliding-window model reuses a state from disk only where the request "
                "parts from it within the window of its end (and needs --swa-full)"
            )
        if info is not None and info.restore_reuse() == "extension":
            return (
                "a recurrent/hybrid model reuses a state from disk only when the request "
                "extends it exactly"
            )
        return "the request's tokens part from the saved ones early (template or echo)"
    found = explain_miss(messages, [held]) if held is not None else None
    if found is not None:
        return found
    return (
        "the messages match as keyed, but the rendered tokens differ (whitespace, "
        "tool-call formatting), or the slot's state came from disk"
    )


def describe(miss: MissExplanation | str, excerpts: bool = True) -> str:
    """One line for the log (a weak hit's cause is already one). Without `excerpts`, where
    the texts part but not what they say: the client's text stays out of sight."""
    if isinstance(miss, str):
        return miss
    where = f"diverged from {miss.where} at message {miss.message_index}, char {miss.char_offset}"
    return f'{where}: "{miss.ours}" vs "{miss.theirs}"' if excerpts else where


async def explain_against(
    namespace: str,
    messages: list[Any],
    candidates: list[tuple[str, list[Any]]],
    store: Store,
) -> MissExplanation | None:
    """Which known conversation of the same namespace a missed request came closest to:
    `candidates` (from slots), else the most recently used stored ones."""
    try:
        # Slots first: a conversation that keeps missing (a timestamp in its system prompt)
        # is usually still in one, and then no stored text needs reading for every miss.
        found = explain_miss(messages, candidates) if candidates else None
        stored = await store.recent_with_text_async(namespace) if found is None else []
        if stored:
            texts = await asyncio.to_thread(store.files.read_many_messages, stored)
            found = explain_miss(messages, [(f"disk {k[:12]}", m) for k, m in texts])
        return found
    except Exception:
        log.exception("explaining a miss failed")
        return None


def wasted_hint(info: ModelInfo | None, swa_full: bool | None, older: bool) -> str:
    """What kvproxy does after restores the server did not reuse (policy.RestoreGuard), and
    what may help: `older`, the entries were saved before the server's current start;
    `swa_full`, whether the server runs with --swa-full (None: not known)."""
    if older:
        return (
            "states saved before this llama-server started are not reused by it (its chat "
            "template, or another setting kvproxy cannot see, changed?): those are no longer "
            "restored for this kind of conversation while it runs; new ones are saved and "
            "restored as usual"
        )
    what = "kvproxy stops restoring and saving this kind of conversation while it runs"
    if info is not None and info.has_swa and swa_full is not True:
        maybe = "" if swa_full is False else " (if it runs without it)"
        return f"{what}. Sliding-window models ({info.architecture}) need --swa-full{maybe}"
    if info is not None and info.model_class in ("recurrent", "hybrid"):
        return (
            f"{what}. A {info.model_class} model reuses a restored state only when the next "
            "prompt extends it exactly"
        )
    return what
