"""A typed client of llama-server's own API: the calls kvproxy makes for itself (slots, save,
restore, erase, tokenize, apply-template, evaluate, props), with their replies as records.

Knows no request and no cache: the cache, the canonical prefix and the doctor all use it, so
an endpoint's path and body shape are written down once. Every call raises UpstreamError
when the server cannot be reached or answers with an error.

In front of a router-mode server a client is bound to one of its models (`ModelRoute`):
every call then names it as the router routes it (docs/how-it-works.md, "Router mode").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import orjson

from kvproxy.http.session import Upstream, UpstreamError

# A slot save or restore moves a whole KV state through the disk.
# Saves and restores take as long as the state's bytes need on this disk: no deadline.
SLOT_ACTION_TIMEOUT: float | None = None


def key_refused(exc: UpstreamError, key_given: bool) -> str | None:
    """What llama-server's 401 to kvproxy's own call means, naming the flag that fixes it;
    None for any other error. (The server's --api-key covers every route but /health.)"""
    if exc.status != 401:
        return None
    if key_given:
        return (
            "llama-server refuses kvproxy's --upstream-api-key: set it to one of "
            "llama-server's --api-key values (env KVPROXY_UPSTREAM_API_KEY)"
        )
    return (
        "llama-server runs with --api-key: pass kvproxy --upstream-api-key KEY "
        "(env KVPROXY_UPSTREAM_API_KEY)"
    )


@dataclass(frozen=True)
class SlotInfo:
    """One slot as GET /slots shows it; `n_prompt_tokens` is None before its first use."""

    id: int
    is_processing: bool
    id_task: Any
    n_prompt_tokens: int | None
    n_ctx: int | None

    @property
    def snapshot(self) -> tuple[Any, int | None]:
        """What changes whenever anyone uses the slot: compared to tell our use from theirs."""
        return (self.id_task, self.n_prompt_tokens)

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> SlotInfo:
        return cls(
            id=int(raw.get("id", -1)),
            is_processing=bool(raw.get("is_processing")),
            id_task=raw.get("id_task"),
            n_prompt_tokens=_int(raw.get("n_prompt_tokens")),
            n_ctx=_int(raw.get("n_ctx")),
        )


@dataclass(frozen=True)
class Saved:
    n_saved: int  # tokens in the saved state
    n_written: int  # bytes the server wrote


@dataclass(frozen=True)
class Restored:
    n_restored: int
    n_read: int


@dataclass(frozen=True)
class ModelRoute:
    """One model of a router-mode llama-server, named the way the router routes a request
    (server-models.cpp): a POST by its body's "model", a GET by `?model=`. `autoload` False
    adds `autoload=false`: a call for a model the router has not loaded is then refused
    (400 "model is not loaded") instead of loading it, which could unload another model;
    True adds `autoload=true`, which loads it whatever the router's own default."""

    name: str
    autoload: bool = False

    def query(self, path: str, get: bool) -> str:
        params = [f"model={quote(self.name, safe='')}"] if get else []
        # Said either way: a router started with --no-models-autoload loads nothing unasked.
        params.append("autoload=true" if self.autoload else "autoload=false")
        return path + ("&" if "?" in path else "?") + "&".join(params)

    def body(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return {**body, "model": self.name}


class LlamaClient:
    """`model`: the router model every call goes to; None for a server of one model."""

    def __init__(self, upstream: Upstream, model: ModelRoute | None = None) -> None:
        self.upstream = upstream
        self.model = model
        # When this client last sent a POST: a router counts a model as used by its POSTs
        # (its least recently used model is the one it unloads).
        self.last_post = 0.0

    def for_model(self, name: str, autoload: bool = False) -> LlamaClient:
        """The same server's client for one of its router models."""
        return LlamaClient(self.upstream, ModelRoute(name, autoload))

    async def _get(self, path: str, timeout: float | None = 30.0) -> Any:
        if self.model is not None:
            path = self.model.query(path, get=True)
        return await self.upstream.get_json(path, timeout=timeout)

    async def _post(self, path: str, body: Mapping[str, Any], *timeout: float | None) -> Any:
        """`timeout`: as given, else the session's default for kvproxy's own POSTs."""
        if self.model is not None:
            path, body = self.model.query(path, get=False), self.model.body(body)
        self.last_post = time.monotonic()
        return await self.upstream.post_json(path, dict(body), *timeout)

    async def load(self) -> None:
        """Make a router load this client's model, and wait until it has: a GET of
        `/props?model=` that may load (and so may unload another model first)."""
        assert self.model is not None, "load() is for a router's model"
        route = ModelRoute(self.model.name, autoload=True)
        await self.upstream.get_json(route.query("/props", get=True), timeout=None)

    async def health(self, timeout: float = 10.0) -> None:
        """The server's (a router's own: it answers whatever its models do)."""
        await self.upstream.get_json("/health", timeout=timeout)

    async def props(self, timeout: float | None = 30.0) -> dict[str, Any]:
        res = await self._get("/props", timeout)
        if not isinstance(res, dict):
            raise UpstreamError(f"GET /props answered {_short(res)}")
        return res

    async def lora_adapters(self) -> list[dict[str, Any]]:
        """GET /lora-adapters: each adapter the server loaded (`id`, `path`, `scale`)."""
        res = await self._get("/lora-adapters")
        if not isinstance(res, list):
            raise UpstreamError(f"GET /lora-adapters answered {_short(res)}")
        return [a for a in res if isinstance(a, dict)]

    async def slots(self) -> list[SlotInfo]:
        res = await self._get("/slots")
        if not isinstance(res, list):
            raise UpstreamError(f"GET /slots answered {_short(res)}")
        return [SlotInfo.from_json(s) for s in res if isinstance(s, Mapping)]

    async def slot(self, slot_id: int) -> SlotInfo:
        for info in await self.slots():
            if info.id == slot_id:
                return info
        raise UpstreamError(f"slot {slot_id} is not in GET /slots")

    async def save(
        self, slot_id: int, filename: str, timeout: float | None = SLOT_ACTION_TIMEOUT
    ) -> Saved:
        res = await self._slot_action(slot_id, "save", {"filename": filename}, timeout)
        return Saved(_need_int(res, "n_saved"), _int(res.get("n_written")) or 0)

    async def restore(
        self, slot_id: int, filename: str, timeout: float | None = SLOT_ACTION_TIMEOUT
    ) -> Restored:
        """A failed restore answers 400 and leaves the slot erased."""
        res = await self._slot_action(slot_id, "restore", {"filename": filename}, timeout)
        return Restored(_int(res.get("n_restored")) or 0, _int(res.get("n_read")) or 0)

    async def erase(self, slot_id: int) -> int:
        res = await self._slot_action(slot_id, "erase", {}, 60.0)
        return _int(res.get("n_erased")) or 0

    async def _slot_action(
        self, slot_id: int, action: str, body: dict[str, Any], timeout: float | None
    ) -> dict[str, Any]:
        res = await self._post(f"/slots/{slot_id}?action={action}", body, timeout)
        if not isinstance(res, dict):
            raise UpstreamError(f"slot {action} answered {_short(res)}")
        return res

    async def refuses(self, path: str) -> bool:
        """Whether the server refuses `path` outright: 501 (not started for it, e.g. no
        --embeddings) or 404 (no such route). Probed with `{}`, which a route it serves
        refuses (400) before it creates any task, so no slot is touched either way."""
        try:
            await self._post(path, {}, 30.0)
        except UpstreamError as exc:
            return exc.status in (404, 501)
        return False

    async def apply_template(self, body: Mapping[str, Any]) -> str:
        """The prompt the server renders for a chat body (messages and template fields)."""
        res = await self._post("/apply-template", body)
        prompt = res.get("prompt") if isinstance(res, dict) else None
        if not isinstance(prompt, str):
            raise UpstreamError(f"/apply-template answered {_short(res)}")
        return prompt

    async def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Tokens as the server tokenises prompts: chat prompts with add_special (BOS);
        without it nothing a chat request caches would match. `parse_special` False reads
        control-token texts as plain text (tokensplit.py proves a marker special with it)."""
        res = await self._post(
            "/tokenize",
            {"content": text, "add_special": add_special, "parse_special": parse_special},
        )
        tokens = res.get("tokens") if isinstance(res, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise UpstreamError(f"/tokenize answered {_short(res)}")
        return tokens

    async def evaluate(
        self, slot_id: int, tokens: list[int] | str, lora: list[dict[str, Any]] | None = None
    ) -> dict[str, Any]:
        """Make the slot hold exactly `tokens` (reusing what it already shares with them; a
        string is tokenised as prompts are, BOS first), generating nothing; returns the
        reply's `timings`. `lora`: the adapters' scales the tokens are computed with (every
        adapter named: the server clears a slot last used with others). No deadline: a
        prefill takes what the server's speed needs (minutes for 10k tokens on a slow CPU),
        and the server goes on computing whatever kvproxy does."""
        body: dict[str, Any] = {
            "prompt": tokens,
            "n_predict": 0,
            "id_slot": slot_id,
            "cache_prompt": True,
        }
        if lora is not None:
            body["lora"] = lora
        res = await self._post("/completion", body, None)
        timings = res.get("timings") if isinstance(res, dict) else None
        return timings if isinstance(timings, dict) else {}

    async def complete(self, body: Mapping[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        """A raw /completion call (the doctor's probes)."""
        res = await self._post("/completion", body, timeout)
        if not isinstance(res, dict):
            raise UpstreamError(f"/completion answered {_short(res)}")
        return res


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _need_int(res: Mapping[str, Any], name: str) -> int:
    value = _int(res.get(name))
    if value is None:
        raise UpstreamError(f"reply has no {name}: {_short(res)}")
    return value


def _short(res: Any) -> str:
    return orjson.dumps(res, default=str)[:200].decode("utf-8", "replace")
