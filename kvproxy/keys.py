"""Conversation keys: a chained hash over canonicalised messages.

key[0] hashes the namespace (model, prompt-shaping request fields, tenant); key[i] hashes
key[i-1] and message i. So every message boundary has a key, and a returning conversation —
turn N+1, a tool loop, a branch — shares its leading keys with what was stored before.

Keys only choose which saved state to load: llama-server compares tokens itself and reuses
only the common prefix, so a collision can cost speed but never correctness.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

KEY_HEX_LEN = 32
# A regex, not a loop over the characters: importing an old cache dir checks every chain key
# of every record (millions at 100k entries).
_KEY = re.compile(f"[0-9a-f]{{{KEY_HEX_LEN}}}")

# Request fields that change the rendered prompt (or how the template renders it).
PROMPT_FIELDS = (
    "tools",
    "chat_template_kwargs",
    "chat_template",
    "reasoning_effort",
    "enable_thinking",
    "parallel_tool_calls",
    "add_generation_prompt",
    "continue_final_message",
)

# Request fields that the server's template rendering reads, beyond the messages.
TEMPLATE_FIELDS = (*PROMPT_FIELDS, "tool_choice", "response_format")


def template_fields(payload: Mapping[str, Any]) -> dict[str, Any]:
    return {name: payload[name] for name in TEMPLATE_FIELDS if name in payload}


class UnkeyableRequest(ValueError):
    """The request's messages cannot be keyed (wrong shapes): it is forwarded uncached."""


def _hash(*parts: bytes) -> str:
    # One call over the joined bytes hashes what streaming each part would, in half the time
    # for the short parts keys are made of (every message of every request is hashed).
    return xxhash.xxh3_128_hexdigest(b"".join(parts))


def _is_object(value: Any) -> bool:
    # Parsed JSON objects are dicts, matched first; the Mapping check (an ABC's, slow) for others.
    return isinstance(value, (dict, Mapping))


@dataclass(frozen=True)
class Identity:
    """What computes a request's KV on one server: `text`, the server's fingerprint (model,
    settings, build: server/fingerprint.py), and the scales its LoRA adapters apply to a
    request that names none (GET /lora-adapters, in adapter order; empty without adapters).
    A request's own `lora` list is part of its key (`for_request`)."""

    text: str
    lora_defaults: tuple[float, ...] = ()

    @classmethod
    def of(cls, identity: Identity | str) -> Identity:
        return identity if isinstance(identity, Identity) else cls(identity)

    def lora_scales(self, payload: Mapping[str, Any]) -> tuple[float, ...]:
        """The scale of each adapter for a request whose body (as it goes to the server) is
        `payload`: its `lora` list sets the adapters it names and 0 for the others, no list
        (or an empty one) leaves the server's (server-context.cpp `construct_lora_list`;
        ids and scales read as `parse_lora_request` reads them, scales as float32)."""
        given = payload.get("lora")
        if not self.lora_defaults or not isinstance(given, list) or not given:
            return self.lora_defaults
        named: dict[int, float] = {}
        for item in given:
            named[_lora_int(item, "id")] = _lora_float(item, "scale")
        return tuple(named.get(i, 0.0) for i in range(len(self.lora_defaults)))

    def for_request(self, payload: Mapping[str, Any]) -> str:
        """The identity a request is keyed under: the server's, with its adapters' scales."""
        if not self.lora_defaults:
            return self.text
        scales = ",".join(repr(s) for s in self.lora_scales(payload))
        return f"{self.text}\0lora={scales}"


def lora_body(scales: Sequence[float]) -> list[dict[str, Any]]:
    """A request's `lora` list naming every adapter with its scale."""
    return [{"id": i, "scale": s} for i, s in enumerate(scales)]


def _lora_int(item: Any, name: str) -> int:
    value = item.get(name) if isinstance(item, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return -1
    return int(value)


def _lora_float(item: Any, name: str) -> float:
    value = item.get(name) if isinstance(item, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return 0.0
    try:
        return float(struct.unpack("<f", struct.pack("<f", value))[0])
    except (OverflowError, struct.error):
        return float("inf") if value > 0 else float("-inf")


def namespace(model_identity: str, request: Mapping[str, Any], tenant: str | None) -> str:
    shaping = {name: request[name] for name in PROMPT_FIELDS if name in request}
    return _hash(
        b"kvproxy-ns-v1\0",
        model_identity.encode(),
        b"\0",
        orjson.dumps(shaping, option=orjson.OPT_SORT_KEYS),
        b"\0",
        (tenant or "").encode(),
    )


def stem(namespace: str, role: str, head: str) -> str:
    """The key of a system message's first characters: a stem entry (cache/prefixes/stems.py)."""
    return _hash(
        b"kvproxy-stem-v1\0", namespace.encode(), b"\0", role.encode(), b"\0", head.encode()
    )


def _content(value: Any) -> Any:
    """`null`, `""` and `[]` are the same; text-only parts join with newlines as the server does.

    Surrounding whitespace is dropped: clients trim replies before echoing them, and a key
    only chooses which state to load (the server still compares tokens)."""
    if value is None or value == "" or value == []:
        return ""
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, list):
        if all(_is_object(p) and p.get("type") == "text" for p in value):
            return "\n".join(str(p.get("text", "")) for p in value).strip()
        return [_part(p) for p in value]
    raise UnkeyableRequest(f"message content of type {type(value).__name__}")


def _part(part: Any) -> Any:
    if not _is_object(part):
        raise UnkeyableRequest("content part is not an object")
    return {k: part[k] for k in sorted(part) if k != "cache_control"}


def _arguments(value: Any) -> Any:
    # Templates see arguments as parsed JSON, so `{"x":1}` and `{"x": 1}` render the same.
    if isinstance(value, str):
        try:
            return orjson.loads(value)
        except orjson.JSONDecodeError:
            return value
    return value


def _tool_calls(value: Any) -> Any:
    if not value:
        return None
    if not isinstance(value, list):
        raise UnkeyableRequest("tool_calls is not a list")
    out = []
    for call in value:
        if not _is_object(call):
            raise UnkeyableRequest("tool call is not an object")
        fn = call.get("function") or {}
        if not _is_object(fn):
            raise UnkeyableRequest("tool call function is not an object")
        out.append([call.get("id"), fn.get("name"), _arguments(fn.get("arguments"))])
    return out


def message_bytes(message: Any) -> bytes:
    """A message as its key hashes it: role, content, tool calls, each normalised as the
    template renders them alike (cache_control and surrounding whitespace left out)."""
    if not _is_object(message):
        raise UnkeyableRequest("message is not an object")
    role = message.get("role")
    if not isinstance(role, str):
        raise UnkeyableRequest("message role is not a string")
    return orjson.dumps(
        [
            role,
            _content(message.get("content")),
            message.get("name"),
            message.get("tool_call_id"),
            _tool_calls(message.get("tool_calls")),
            message.get("reasoning_content") or None,
        ]
    )


def chain(ns: str, messages: Sequence[Any]) -> list[str]:
    """Prefix keys: result[i] covers messages[:i+1]."""
    keys: list[str] = []
    key = ns
    for message in messages:
        key = extend(key, message)
        keys.append(key)
    return keys


def extend(prev_key: str, message: Mapping[str, Any]) -> str:
    return _hash(prev_key.encode(), b"\0", message_bytes(message))


def tenant_of(headers: Mapping[str, str], tenant_header: str | None, salt: bytes) -> str | None:
    """A hash of who is asking: the configured header, else the client's API key as
    llama-server reads it (`Authorization`, else `X-Api-Key` as the same bearer token).
    Salted with the install's secret (store/salt.py): who knows a key cannot find its
    tenant's files or rows by hashing it."""
    if tenant_header:
        raw = headers.get(tenant_header)
    else:
        api_key = headers.get("X-Api-Key")
        raw = headers.get("Authorization") or (f"Bearer {api_key}" if api_key else None)
    if not raw:
        return None
    return _hash(b"kvproxy-tenant-v2\0", salt, b"\0", header_bytes(raw))


def header_bytes(value: str) -> bytes:
    """A header value's bytes as the client sent them: aiohttp decodes bytes that are not
    UTF-8 (`\\xff`) to lone surrogates, which a plain `.encode()` refuses."""
    return value.encode("utf-8", "surrogateescape")


def is_key(name: str) -> bool:
    return _KEY.fullmatch(name) is not None


def shared_chain(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading keys two key chains share (`shared_prefix` of the two). Each key
    hashes the one before it, so chains that agree at a boundary agree at every one before:
    found by bisection, and at once when one chain extends the other (a next turn)."""
    lo, hi = 0, min(len(a), len(b))
    if hi == 0 or a[hi - 1] == b[hi - 1]:
        return hi
    while hi - lo > 1:  # the chains agree at `lo` boundaries, not at `hi`
        mid = (lo + hi) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid
    return lo


def shared_prefix(a: Sequence[object], b: Sequence[object]) -> int:
    """How many leading items two sequences share: for key chains, the messages both
    conversations start with; for token lists, what a server could reuse."""
    n = 0
    for mine, theirs in zip(a, b, strict=False):
        if mine != theirs:
            break
        n += 1
    return n
