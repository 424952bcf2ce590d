"""What clients change in earlier messages on their next turn, learnt per namespace.

Besides echoing the reply (echo.EchoStyles), real agents rewrite what they sent:

- DROP: a message is gone from the next request. OpenClaw ends each turn with a user message
  `<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>…`; the next turn drops it and appends a fresh one
  after the new user message.
- CUT: a message comes back with a piece of its text removed. aider appends its "To suggest
  changes to a file you MUST…" reminder to the last user message and sends that message
  without it on the next turn.

A state saved as the slot holds it then parts from the next request before the reply: dense
models still reuse the prefix, but a restored sliding-window state reuses it only within the
window of its end, and a recurrent or hybrid one not at all. So once a namespace's client has
shown a rewrite, a save first rewrites the conversation as the client will send it next
(`rewrite`), and the canonical prefix is computed over that: the saved state is then one the
next request extends exactly, on every model class.

One observation teaches a rewrite, and only a strict one: the messages after the changed one
must come back unchanged, so a client that edits or regenerates a turn teaches nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from kvproxy.keys import UnkeyableRequest, message_bytes, shared_prefix

log = logging.getLogger("kvproxy.cache")

# A removed text or a dropped message's opening this short could match ordinary messages.
MIN_TEXT = 8
MARKER_CHARS = 64  # how much of a dropped message's opening identifies its kind
MAX_CUT = 16_384  # a removed text longer than this is not a fixed reminder
PER_NAMESPACE = 4


class Kind(StrEnum):
    DROP = "drop"
    CUT = "cut"


@dataclass(frozen=True)
class Rewrite:
    kind: Kind
    role: str
    # DROP: the opening of the dropped message's text; CUT: the text removed.
    text: str

    def apply(self, message: Any) -> Any | None:
        """The message as the client will send it next (None: dropped)."""
        content = _text(message)
        if content is None or message.get("role") != self.role:
            return message
        if self.kind is Kind.DROP:
            return None if content.lstrip().startswith(self.text) else message
        if self.text not in content or not isinstance(message.get("content"), str):
            return message
        return {**message, "content": content.replace(self.text, "", 1)}


def _text(message: Any) -> str | None:
    """The message's text: its content, or its text parts joined (OpenClaw sends its
    context message as a list of parts)."""
    if not isinstance(message, Mapping):
        return None
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = [p.get("text") for p in content if isinstance(p, Mapping)]
        if len(texts) == len(content) and all(isinstance(t, str) for t in texts):
            return "".join(t for t in texts if isinstance(t, str))
    return None


def _same(a: Any, b: Any) -> bool:
    try:
        return message_bytes(a) == message_bytes(b)
    except UnkeyableRequest:
        return False


def observe(ours: Sequence[Any], theirs: Sequence[Any], first: int) -> Rewrite | None:
    """The rewrite `theirs`, the request after `ours` (the recorded conversation, its reply
    last), shows, if it shows exactly one before the reply and nothing else changed. `first`:
    the index of the first message that differs (the depth their key chains share)."""
    n = len(ours)
    if not 0 <= first < n - 1 or len(theirs) < n:
        return None  # a change in the reply itself is EchoStyles'
    mine = ours[first]
    if _same(mine, theirs[first]):
        return None
    role, content = (mine.get("role"), _text(mine)) if isinstance(mine, Mapping) else (None, None)
    if not isinstance(role, str) or content is None:
        return None
    # DROP: every later message comes back one place earlier, and one more follows.
    if all(_same(ours[j], theirs[j - 1]) for j in range(first + 1, n)):
        marker = content.lstrip().split("\n", 1)[0][:MARKER_CHARS]
        if len(marker) >= MIN_TEXT:
            return Rewrite(Kind.DROP, role, marker)
    # CUT: the same message less one piece of text, every later one unchanged, more after.
    got = _text(theirs[first])
    if (
        len(theirs) <= n
        or got is None
        or not isinstance(mine.get("content"), str)  # a cut is applied to plain text only
        or theirs[first].get("role") != role
        or len(got) >= len(content)
    ):
        return None
    if not all(_same(ours[j], theirs[j]) for j in range(first + 1, n)):
        return None
    head = shared_prefix(content, got)
    tail = shared_prefix(content[head:][::-1], got[head:][::-1])
    if head + tail != len(got):
        return None
    removed = content[head : len(content) - tail]
    if MIN_TEXT <= len(removed) <= MAX_CUT and content.replace(removed, "", 1) == got:
        return Rewrite(Kind.CUT, role, removed)
    return None


def rewrite(rewrites: Sequence[Rewrite], messages: Sequence[Any]) -> list[Any]:
    """The conversation as its client will send it next: every message but the last (the
    reply, which EchoStyles covers) rewritten as the client has been seen to."""
    out: list[Any] = []
    for message in messages[:-1]:
        current: Any | None = message
        for rule in rewrites:
            current = rule.apply(current)
            if current is None:
                break
        if current is not None:
            out.append(current)
    out.extend(messages[-1:])
    return out


class Rewrites:
    """The rewrites each namespace's client has shown (a few, the newest kept)."""

    def __init__(self) -> None:
        self._seen: dict[str, list[Rewrite]] = {}
        self.changes = 0  # how many times a rule was learnt (habits.py writes them out)

    def get(self, namespace: str) -> list[Rewrite]:
        return self._seen.get(namespace, [])

    def forget(self, namespace: str) -> None:
        self._seen.pop(namespace, None)

    def to_json(self) -> dict[str, list[list[str]]]:
        return {
            ns: [[r.kind.value, r.role, r.text] for r in rules] for ns, rules in self._seen.items()
        }

    def load(self, data: Any) -> None:
        """Rules written by `to_json` (anything else is skipped)."""
        if not isinstance(data, Mapping):
            return
        for ns, rules in data.items():
            if not isinstance(ns, str) or not isinstance(rules, list):
                continue
            kept = [
                Rewrite(Kind(r[0]), r[1], r[2])
                for r in rules
                if isinstance(r, list)
                and len(r) == 3
                and r[0] in (k.value for k in Kind)
                and all(isinstance(x, str) for x in r)
                and len(r[2]) >= MIN_TEXT
            ]
            if kept:
                self._seen[ns] = kept[-PER_NAMESPACE:]

    def learn(
        self, namespace: str, ours: Sequence[Any], theirs: Sequence[Any], first: int
    ) -> Rewrite | None:
        found = observe(ours, theirs, first)
        if found is None:
            return None
        known = self._seen.setdefault(namespace, [])
        if found not in known:
            known.append(found)
            del known[:-PER_NAMESPACE]
            self.changes += 1
            log.info(
                "learnt a client habit: it %s %s; saves now store what it sends next",
                "drops the previous turn's message starting"
                if found.kind is Kind.DROP
                else "removes from earlier messages the text",
                repr(found.text[:60]),
            )
        return found
