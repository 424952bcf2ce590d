"""Wire adapters: one per client API. An adapter turns a request body into a Conversation
the cache can key (or says why it cannot), writes the body pinned to a slot, and captures
the reply from the bytes relayed back. It knows no aiohttp server internals and no slots.

Chat completions (chat.py), Anthropic Messages (messages.py, with the conversion in
anthropic.py), OpenAI Responses (responses.py), and text completions and code infill
(prompts.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from kvproxy import keys
from kvproxy.wire.capture import Reply


@dataclass(frozen=True)
class Tail:
    """How much of the end of what a slot holds a request may drop and still go on from it
    (nothing there is worth a save first): at least `boundaries`, or `share` of them."""

    boundaries: int
    share: float = 0.0

    def of(self, held_depth: int) -> int:
        return max(self.boundaries, int(held_depth * self.share))


# A chat may drop the slot's last message: a regenerated reply.
CHAT_TAIL = Tail(1)


@dataclass
class Conversation:
    """One keyed request: what the cache needs to know about it."""

    payload: dict[str, Any]
    namespace: str
    keys: list[str]  # keys[i] covers messages[:i+1]
    messages: list[Any]
    template: dict[str, Any]  # request fields the chat template reads besides the messages
    tenant: str | None = None  # keys.tenant_of the request: who may share its slot's tokens
    # What this request may drop of the end of a slot's state and still go on from it,
    # rather than replace it (a chat's regenerated reply; an editor's next completion).
    tail: Tail = CHAT_TAIL
    # The scale of each of the server's LoRA adapters for this request (keys.Identity), and
    # whether they are the server's own (what a request naming none gets). Empty: none.
    lora: tuple[float, ...] = ()
    lora_default: bool = True

    def lora_body(self) -> list[dict[str, Any]] | None:
        """Every adapter named with its scale, for a body sent to the server: a request
        naming no adapter leaves the slot's last setting in place (and its cache: a slot's
        KV computed with another adapter would be reused), one naming them makes the server
        clear the cache of a slot last used with other scales. None: no adapters."""
        return keys.lora_body(self.lora) if self.lora else None


@dataclass(frozen=True)
class NotKeyed:
    """Why a request is forwarded without the cache keying it. `several_slots`: the server
    would run it on more than one slot, so it must hold every slot even where `id_slot` pins."""

    reason: str
    several_slots: bool = False


def several_slots(payload: Mapping[str, Any]) -> bool:
    """Whether the server runs this completion on more than one slot: `n_cmpl`, or its alias
    `n` when `n_cmpl` is absent or null (server-schema.cpp), above 1 starts child tasks on
    other idle slots, whatever `id_slot` says (server-context.cpp `get_free_slots`). The
    server reads the number as nlohmann's `get<int32_t>`: booleans are 0 or 1, fractions are
    cut off. Anything else it refuses (400, no slot); counted as several to be safe."""
    for name in ("n_cmpl", "n"):
        value = payload.get(name)
        if value is None:
            continue
        if isinstance(value, bool):
            return False
        return not (isinstance(value, int | float) and value < 2)
    return False


class Capture(Protocol):
    """Fed the upstream reply's bytes as they pass; makes sense of them afterwards. The
    Reply's `timings` carry `cache_n`/`prompt_n` (from `usage` where the API has no timings)."""

    def feed(self, chunk: bytes) -> None: ...

    def finish(self) -> Reply | None: ...


class Translator(Protocol):
    """Turns the upstream reply into the client's wire format, chunk by chunk (for an API the
    server cannot pin, whose requests go to one it can)."""

    def feed(self, chunk: bytes) -> bytes: ...

    def finish(self) -> bytes: ...

    def broke_off(self, message: str) -> bytes | None:
        """The last bytes of a reply the server broke off (an error event), or None when the
        body must be cut short instead."""
        ...


class WireAdapter(Protocol):
    name: str
    # Whether the client's own route honours `id_slot` (a request not keyed is pinned there;
    # otherwise it holds every slot while the server picks one).
    route_pins: bool

    def read(
        self, payload: dict[str, Any], model_identity: keys.Identity | str, tenant: str | None
    ) -> Conversation | NotKeyed: ...

    def pinned(self, payload: dict[str, Any], slot_id: int) -> bytes:
        """The body to forward, pinned to the slot."""
        ...

    def upstream_path(self, path_qs: str) -> str:
        """Where the pinned request goes on the server."""
        ...

    def translator(self, conversation: Conversation) -> Translator | None:
        """None: the server's reply goes to the client unchanged."""
        ...

    def capture(self, conversation: Conversation) -> Capture: ...

    def echoed(self, reply: Reply) -> dict[str, Any] | None:
        """The reply as the client will send it back in its next request (None: the next
        request does not carry it, as a prompt's)."""
        ...


class NativeRoute:
    """What the adapters of an API the server speaks itself (chat, prompts, Responses) share:
    the client's body goes where it was sent, pinned, and the reply back unchanged."""

    route_pins = True

    def pinned(self, payload: dict[str, Any], slot_id: int) -> bytes:
        return orjson.dumps({**payload, "id_slot": slot_id})

    def upstream_path(self, path_qs: str) -> str:
        return path_qs

    def translator(self, conversation: Conversation) -> None:
        return None


def keyed(
    payload: dict[str, Any],
    rendered: dict[str, Any],
    model_identity: keys.Identity | str,
    tenant: str | None,
) -> Conversation | NotKeyed:
    """Key a request whose chat-form body, as the server renders it, is `rendered` (its
    `messages` keyed one by one, its prompt-shaping fields in the namespace); `payload` is
    what goes to the server (its `lora` in the namespace)."""
    messages = rendered.get("messages")
    if not isinstance(messages, list) or not messages:
        return NotKeyed("no messages")
    if several_slots(rendered):
        return NotKeyed("more than one completion (n, n_cmpl)", several_slots=True)
    if "lora" in payload and not isinstance(payload["lora"], list):
        return NotKeyed("lora is not a list")  # the server refuses it (400)
    identity = keys.Identity.of(model_identity)
    ns = keys.namespace(identity.for_request(payload), rendered, tenant)
    try:
        chain = keys.chain(ns, messages)
    except keys.UnkeyableRequest as exc:
        return NotKeyed(str(exc))
    template = keys.template_fields(rendered)
    conv = Conversation(payload, ns, chain, messages, template, tenant)
    return with_lora_of(conv, identity, payload)


def with_lora_of(
    conv: Conversation, identity: keys.Identity, payload: Mapping[str, Any]
) -> Conversation:
    """`conv` with the adapter scales its request gets from the server (`payload`: the body
    as it goes there)."""
    conv.lora = identity.lora_scales(payload)
    conv.lora_default = conv.lora == identity.lora_defaults
    return conv


def with_lora(payload: dict[str, Any], lora: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The payload naming every adapter (`lora`), or without a `lora` list (None)."""
    if lora is not None:
        return {**payload, "lora": lora}
    if "lora" in payload:
        return {k: v for k, v in payload.items() if k != "lora"}
    return payload


# Every field a client sets a reply's length with, on the routes kvproxy keys; the server
# reads `n_predict`, then `max_tokens` (the Messages and Responses APIs are converted to it).
REPLY_LIMITS = ("n_predict", "max_tokens", "max_completion_tokens", "max_output_tokens")


def with_reply_cap(payload: dict[str, Any], cap: int) -> dict[str, Any]:
    """The payload with `n_predict: cap` when it sets no reply length (cap < 0: as it is).
    Not llama-server's --n-predict: that also cuts requests asking for more, and shrinks the
    context an /infill prompt is given (format_prompt_infill keeps n_ctx - n_batch -
    2 * --n-predict tokens of extra chunks)."""
    if cap < 0 or any(field in payload for field in REPLY_LIMITS):
        return payload
    # A Responses body is converted by the server, which keeps its own fields only.
    field = "max_output_tokens" if "input" in payload and "messages" not in payload else "n_predict"
    return {**payload, field: cap}
