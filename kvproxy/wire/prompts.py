"""Text-completion and code-infill requests (`/completion`, `/v1/completions`, `/infill`):
keyed over the prompt as the server assembles it, in fixed-size blocks.

A chat is keyed message by message; a raw prompt has no messages, so its text is cut into
blocks of `BLOCK_CHARS` characters from its start, each key covering every block before
it (a prefix chain, as for messages). Two prompts share key depth d exactly when their
first d blocks are equal, so the deepest shared key is the longest common prefix to within
a block: the slot the server itself would pick, and the stored state it would reuse most.

`/infill` is keyed on what the server puts first (server-common.cpp
`format_prompt_infill`): the extra context chunks (`input_extra`, each a file name and its
text), then `input_prefix`; the suffix and the text after the cursor follow the prefix in
the assembled prompt, so they only ever extend it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from kvproxy import keys
from kvproxy.wire import Conversation, NotKeyed, several_slots, with_lora_of

BLOCK_CHARS = 256

# Routes whose body is a raw prompt, by the namespace they key in: `/completion` and the
# OpenAI-compatible `/v1/completions` tokenize the same prompt alike.
PROMPT_ROUTES = {
    "/completion": "completion",
    "/completions": "completion",
    "/v1/completions": "completion",
    "/infill": "infill",
}


def _blocks(text: str) -> list[dict[str, Any]]:
    return [
        {"role": "text", "content": text[i : i + BLOCK_CHARS]}
        for i in range(0, len(text), BLOCK_CHARS)
    ]


def _prompt_text(prompt: Any) -> str | None:
    """The prompt as one text: a string, a one-string list, or a token list (written out,
    so equal token prefixes give equal blocks). None: several prompts or multimodal parts."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return "".join(f"{t}," for t in prompt)
    return None


def leading_text(payload: Mapping[str, Any], depth: int) -> str | None:
    """The text of a completion prompt's first `depth` blocks (None: not a text prompt)."""
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    return prompt[: depth * BLOCK_CHARS] if isinstance(prompt, str) else None


def _infill_text(payload: Mapping[str, Any]) -> str | None:
    extra = payload.get("input_extra", [])
    prefix = payload.get("input_prefix", "")
    if not isinstance(extra, list) or not isinstance(prefix, str):
        return None
    parts: list[str] = []
    for chunk in extra:
        if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
            return None  # the server refuses it (400) before it touches a slot
        parts.append(orjson.dumps([chunk.get("filename"), chunk["text"]]).decode())
    parts.append(prefix)
    return "\0".join(parts)


def read_prompt(
    path: str, payload: Mapping[str, Any], model_identity: keys.Identity | str, tenant: str | None
) -> Conversation | NotKeyed:
    kind = PROMPT_ROUTES.get(path)
    if kind is None:
        return NotKeyed("not a prompt route")
    if several_slots(payload):
        return NotKeyed("more than one completion (n, n_cmpl)", several_slots=True)
    if payload.get("cache_prompt") is False:
        return NotKeyed("cache_prompt is off")
    text = _infill_text(payload) if kind == "infill" else _prompt_text(payload.get("prompt"))
    if not text:
        return NotKeyed("no single text prompt")
    if "lora" in payload and not isinstance(payload["lora"], list):
        return NotKeyed("lora is not a list")  # the server refuses it (400)
    identity = keys.Identity.of(model_identity)
    ns = keys.namespace(f"{identity.for_request(payload)}\0{kind}", {}, tenant)
    chain = keys.chain(ns, _blocks(text))
    return with_lora_of(Conversation(dict(payload), ns, chain, [], {}, tenant), identity, payload)
