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
TRIMS = {VERBATIM: None, STRIPPED: str.strip, RSTRIPPED: str.rstrip}


def echo_variants(reply: Mapping[str, Any], style: str | None = None) -> list[dict[str, Any]]:
    """The reply as clients may send it back, with tool-call arguments re-serialised with and
    without spaces. With `style` unknown: as generated and with surrounding whitespace
    trimmed (the prefix then stops where they differ); with `style` seen: that form only.
    Where the template renders these alike, they cost nothing."""
    trims = [TRIMS[style]] if style in TRIMS else [None, str.strip]
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
