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

The reply adds nothing to the keys (an editor's next request is its own prompt again): what
a slot holds after it is the prompt's chain. A text completion that keeps all but the last
tenth of what a slot holds goes on from it (`Conversation.tail`: an editor's next
request at the same place); `/infill` does not, as the server truncates the prompt it
assembles (blocks equal from the start can still be different tokens).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from kvproxy import keys
from kvproxy.wire import (
    Conversation,
    NativeRoute,
    NotKeyed,
    Tail,
    several_slots,
    with_lora_of,
)
from kvproxy.wire.capture import CapturedBytes, Reply

BLOCK_CHARS = 256
# What a text completion may drop of a slot's state and still go on from it (the same text,
# edited near its end: an editor's next request): its last tenth, one block at least.
NEAR_END = Tail(1, 0.1)
# An infill drops nothing: blocks equal from the start can still be different tokens.
EXACT = Tail(0)

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
    kind: str, payload: Mapping[str, Any], model_identity: keys.Identity | str, tenant: str | None
) -> Conversation | NotKeyed:
    """A prompt of `kind` ("completion" or "infill", PROMPT_ROUTES) as a conversation."""
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
    tail = NEAR_END if kind == "completion" else EXACT
    conv = Conversation(dict(payload), ns, chain, [], {}, tenant, tail=tail)
    return with_lora_of(conv, identity, payload)


class PromptAdapter(NativeRoute):
    """`/completion`, `/v1/completions` (kind "completion") or `/infill` (kind "infill")."""

    def __init__(self, kind: str) -> None:
        self.name = kind
        self.kind = kind

    def read(
        self, payload: dict[str, Any], model_identity: keys.Identity | str, tenant: str | None
    ) -> Conversation | NotKeyed:
        return read_prompt(self.kind, payload, model_identity, tenant)

    def capture(self, conversation: Conversation) -> PromptCapture:
        return PromptCapture(streaming=bool(conversation.payload.get("stream")))

    def echoed(self, reply: Reply) -> None:
        return None  # the next request is a prompt of its own: the reply adds no key


class PromptCapture(CapturedBytes):
    """A completion's end, streamed or not: whether it came whole, and its timings. The
    server's own completion (server-task.cpp `to_json_non_oaicompat`: `"stop": true`) or the
    OpenAI one (`to_json_oaicompat`: a choice with a `finish_reason`)."""

    def finish(self) -> Reply | None:
        if self._overflow:
            return None
        reply = Reply()
        try:
            if self.streaming:
                for line in bytes(self._buf).replace(b"\r\n", b"\n").split(b"\n"):
                    data = line[5:].strip() if line.startswith(b"data:") else b""
                    if data and data != b"[DONE]":
                        _read_final(orjson.loads(data), reply)
            else:
                _read_final(orjson.loads(bytes(self._buf)), reply)
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError):
            return None
        return reply


def _read_final(chunk: Any, reply: Reply) -> None:
    if not isinstance(chunk, dict):
        return
    if isinstance(chunk.get("timings"), dict):
        reply.timings = chunk["timings"]
    if chunk.get("stop") is True:
        reply.finish_reason = "length" if chunk.get("stop_type") == "limit" else "stop"
    for choice in chunk.get("choices") or []:
        if isinstance(choice, dict) and choice.get("finish_reason"):
            reply.finish_reason = str(choice["finish_reason"])
