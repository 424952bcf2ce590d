"""The canonical prefix: the tokens a conversation's next request will certainly start with.

Right after a reply, a slot holds the prompt plus the tokens the model generated. The next
request carries the reply as the client echoes it, rendered by the chat template: other
tokens at the end (an end-of-turn marker instead of the last sampled token, whitespace a
client trimmed, tool-call arguments it re-serialised, reasoning it dropped). A model with
full attention reuses the common prefix anyway; recurrent and hybrid models, and restored
states without context checkpoints, reuse nothing unless the next prompt extends the saved
tokens exactly. So before a save the slot is made to hold exactly the prefix every plausible
next request shares: rendered by the server's own template for a few echo styles and a few
next messages, tokenised as the server tokenises prompts, cut at the longest common prefix.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from kvproxy.cache.canonical.tokensplit import Heads, tokenize_all
from kvproxy.http.session import UpstreamError
from kvproxy.server.api import LlamaClient

__all__ = ["Heads"]  # slotwork and openings hold theirs through this module

# Another way for the renders to become tokens (tokensplit.tokenize_each: the full path).
TokenizeAll = Callable[[LlamaClient, Sequence[str]], Awaitable[list[list[int]]]]

# Two next messages that share nothing after their role marker, so the common prefix stops
# right where the next message's content starts.
NEXT_MESSAGES = (
    {"role": "user", "content": "A"},
    {"role": "user", "content": "Zebra, 42?"},
)


# How a client sends replies back, as far as kvproxy has seen (EchoStyle per namespace).
VERBATIM, STRIPPED, RSTRIPPED = "verbatim", "strip", "rstrip"
_TRIMS = {VERBATIM: None, STRIPPED: str.strip, RSTRIPPED: str.rstrip}


def echo_variants(reply: Mapping[str, Any], style: str | None = None) -> list[dict[str, Any]]:
    """The reply as clients may send it back, with tool-call arguments re-serialised with and
    without spaces. With `style` unknown: as generated and with surrounding whitespace
    trimmed (the prefix then stops where they differ); with `style` seen: that form only.
    Where the template renders these alike, they cost nothing."""
    trims = [_TRIMS[style]] if style in _TRIMS else [None, str.strip]
    variants: list[dict[str, Any]] = []
    for trim in trims:
        for separators in (None, (", ", ": "), (",", ":")):
            other = copy.deepcopy(dict(reply))
            if trim is not None and isinstance(other.get("content"), str):
                other["content"] = trim(other["content"]) or None
            for call in other.get("tool_calls") or []:
                fn = call.get("function") if isinstance(call, dict) else None
                if separators and isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                    fn["arguments"] = _reserialised(fn["arguments"], separators)
            if other not in variants:
                variants.append(other)
    return variants


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


def _reserialised(arguments: str, separators: tuple[str, str]) -> str:
    # The stdlib, not orjson: clients write both spacings, orjson only the compact one.
    try:
        return json.dumps(json.loads(arguments), separators=separators, ensure_ascii=False)
    except ValueError:
        return arguments


def renderable(messages: Sequence[Any]) -> bool:
    """Text-only conversations: media parts become tokens only the server can compute."""
    for message in messages:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(
            not isinstance(p, Mapping) or p.get("type") != "text" for p in content
        ):
            return False
    return True


def common_prefix(sequences: Sequence[Sequence[int]]) -> list[int]:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        token = first[i]
        if any(s[i] != token for s in sequences[1:]):
            n = i
            break
    return list(first[:n])


async def prefix_tokens(
    client: LlamaClient,
    fields: Mapping[str, Any],
    messages: Sequence[Any],
    style: str | None = None,
    heads: Heads | None = None,
    tokenize: TokenizeAll | None = None,
) -> list[int] | None:
    """The canonical prefix of the request after `messages` (whose last one is the reply as
    echoed), or None when the server cannot render it (then the slot is saved as it is).
    `heads`: what earlier saves tokenised (tokensplit.py), to tokenise only the new text;
    `tokenize`: another way to tokenise the renders (the full path, to compare)."""
    prompts = await renders(client, fields, messages, style)
    if prompts is None:
        return None
    if tokenize is None:
        token_lists = await tokenize_all(client, prompts, heads)
    else:
        token_lists = await tokenize(client, prompts)
    return common_prefix(token_lists) or None


async def renders(
    client: LlamaClient,
    fields: Mapping[str, Any],
    messages: Sequence[Any],
    style: str | None = None,
) -> list[str] | None:
    """The distinct prompts of the plausible next requests, or None when they tell nothing."""
    if not messages or not renderable(messages):
        return None
    history, reply = list(messages[:-1]), messages[-1]
    variants = echo_variants(reply, style)
    probes = [[*history, variants[0], nxt] for nxt in NEXT_MESSAGES]
    probes += [[*history, echo, NEXT_MESSAGES[0]] for echo in variants[1:]]
    prompts = await asyncio.gather(*(render(client, fields, m) for m in probes))
    unique = list(dict.fromkeys(p for p in prompts if p is not None))
    if len(unique) < 2:
        # One rendering (or none) tells nothing about where the next message starts.
        return None
    return unique


async def render(client: LlamaClient, fields: Mapping[str, Any], messages: list[Any]) -> str | None:
    try:
        return await client.apply_template({**fields, "messages": messages})
    except UpstreamError:
        # A template may refuse one of the probe shapes (say, a tool reply where it expects
        # none); the other probes still bound the prefix.
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
                (ns, style) for ns, style in data.items() if isinstance(ns, str) and style in _TRIMS
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
