"""How each namespace's client echoes the reply it got back on its next turn: verbatim, or
with surrounding whitespace trimmed. Learnt from the request that continues a recorded
conversation; the canonical prefix (canonical/prefix.py) renders that style only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvproxy.cache.canonical.prefix import RSTRIPPED, STRIPPED, TRIMS, VERBATIM


def observe_echo(ours: Mapping[str, Any], theirs: Any) -> str | None:
    """How the client echoed the reply kvproxy captured, when that tells anything."""
    mine = ours.get("content")
    got = theirs.get("content") if isinstance(theirs, Mapping) else None
    if not isinstance(mine, str) or not isinstance(got, str) or mine == mine.strip():
        return None  # no surrounding whitespace: every style looks the same
    if got == mine:
        return VERBATIM
    if got == mine.strip():
        return STRIPPED
    if got == mine.rstrip():
        return RSTRIPPED
    return None


class EchoStyles:
    """How each namespace's client echoes replies, learnt from its next turn (observe_echo):
    once known, the canonical prefix renders that style only and takes in the whole reply."""

    def __init__(self) -> None:
        self._styles: dict[str, str] = {}
        self.changes = 0  # how many times a style was learnt or changed

    def get(self, namespace: str) -> str | None:
        return self._styles.get(namespace)

    def forget(self, namespace: str) -> None:
        self._styles.pop(namespace, None)

    def to_json(self) -> dict[str, str]:
        return dict(self._styles)

    def load(self, data: Any) -> None:
        """Styles written by `to_json` (anything else is skipped)."""
        if isinstance(data, Mapping):
            self._styles.update(
                (ns, style) for ns, style in data.items() if isinstance(ns, str) and style in TRIMS
            )

    def known(self, namespace: str) -> bool:
        return namespace in self._styles

    def learn(self, namespace: str, ours: Sequence[Any], theirs: Sequence[Any]) -> None:
        """`ours`: the conversation as kvproxy recorded it (the reply last); `theirs`: the
        request that continues it, whose message at the reply's index is the echo."""
        n = len(ours)
        if n == 0 or len(theirs) < n:
            return
        style = observe_echo(ours[-1], theirs[n - 1])
        if style is not None and self._styles.get(namespace) != style:
            self._styles[namespace] = style
            self.changes += 1
