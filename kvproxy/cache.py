"""The conversation cache: for each chat request, get its KV state into a slot, then forward.

Per request: key the conversation, take a slot (the one holding its longest prefix, else an
idle one), make sure the slot still holds what we think (GET /slots), save the slot's other
conversation if it would be lost, restore a longer prefix from disk if there is one, pin the
request to the slot with `id_slot`, relay the reply while capturing it, and record what the
slot now holds. Saves happen at eviction, after an idle while, on shutdown (write-back), or
after every reply (write-through).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import orjson
from aiohttp import web

from . import canonical
from . import keys as keymod
from .config import Settings
from .errors import error_response
from .events import Listener, MissExplanation, RequestEvent, SlotActionEvent
from .explain import explain_miss
from .modelinfo import ModelInfo, read_model_info
from .relay import relay
from .replies import ReplyCapture
from .slots import Holding, QueueFull, Slot, SlotPool
from .store import Entry, Store
from .upstream import Upstream, UpstreamError

log = logging.getLogger("kvproxy.cache")

_T = TypeVar("_T")

HOUSEKEEPING_INTERVAL = 1.0
PROPS_CHECK_INTERVAL = 15.0
BUSY_WAIT_LIMIT = 120.0
# Restores the server did not reuse, in a row, before kvproxy stops restoring for a namespace.
INEFFECTIVE_LIMIT = 3
# How long what GET /slots showed after our own last use is trusted for a "resident" claim
# while no other slot got work (see SlotPool.still_as_seen). A wrong claim costs one slower
# request, never a wrong answer (the server compares tokens); checking costs a round trip on
# every request. Slot actions always check first.
SNAPSHOT_TRUST = 1.0
# While the server refuses GET /slots (caching off), how often a chat request may look again.
REDISCOVER_INTERVAL = 1.0


@dataclass
class Plan:
    """What the cache knows about one chat request."""

    payload: dict[str, Any]
    namespace: str
    keys: list[str]
    messages: list[Any]


@dataclass
class Stats:
    requests: dict[str, int] = field(
        default_factory=lambda: {"resident": 0, "restored": 0, "miss": 0, "bypass": 0}
    )
    saves: int = 0
    save_failures: int = 0
    restores: int = 0
    restore_failures: int = 0
    saved_bytes: int = 0
    restored_tokens: int = 0
    evictions: int = 0
    cache_n: int = 0
    prompt_n: int = 0
    slot_resets_seen: int = 0
    ineffective_restores: int = 0


class ConversationCache:
    def __init__(self, settings: Settings, upstream: Upstream) -> None:
        self.settings = settings
        self.upstream = upstream
        self.store = Store(Path(settings.cache_dir), settings.ttl, int(settings.max_disk))
        self.pool = SlotPool(1, settings.max_queue, settings.queue_timeout)
        self.stats = Stats()
        self.enabled = False  # slot pinning works (GET /slots answered)
        self.disk_enabled = True  # slot save/restore works (--slot-save-path set)
        self.model_identity = ""
        self._housekeeper: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self._last_props_check = 0.0
        # When a server that answered /props last refused GET /slots: requests then look again
        # at most every REDISCOVER_INTERVAL. A server that was not up is asked at once.
        self._no_slots_seen = 0.0
        # How each namespace's client echoes replies (canonical.observe_echo).
        self._echo_styles: dict[str, str] = {}
        self._disk_error_logged = False
        self._ineffective_streak: dict[str, int] = {}
        self._restores_off: set[str] = set()
        self.listeners: list[Listener] = []
        self.model_info: ModelInfo | None = None

    # --- life cycle

    async def start(self) -> None:
        await self.store.open_async()
        try:
            await self._discover()
        except UpstreamError as exc:
            log.warning("llama-server not ready (%s); will retry in the background", exc)
        self._housekeeper = asyncio.create_task(self._housekeeping())

    async def stop(self) -> None:
        if self._housekeeper is not None:
            self._housekeeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._housekeeper
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        if self.enabled:
            for slot in self.pool.slots:
                if self._worth_saving(slot):
                    with contextlib.suppress(QueueFull, UpstreamError, OSError):
                        got, _ = await self.pool.acquire(wanted=slot.id)
                        try:
                            await self._verify(got)
                            await self._save(got)
                        finally:
                            self.pool.release(got)

    async def _discover(self) -> None:
        props = await self.upstream.get_json("/props")
        identity = await asyncio.to_thread(_model_identity, props)
        try:
            slots = await self.upstream.get_json("/slots")
        except UpstreamError as exc:
            if self.enabled or self.model_identity != identity:
                log.warning("GET /slots failed (%s): caching is off, requests pass through", exc)
            self._no_slots_seen = time.monotonic()
            self.enabled = False
            self.model_identity = identity
            return
        if identity != self.model_identity or len(slots) != len(self.pool.slots):
            if self.model_identity:
                log.info("llama-server changed (model or slots): forgetting what slots held")
            self.pool.resize(len(slots))
            self.pool.forget_all()
            self.model_identity = identity
            self.model_info = await asyncio.to_thread(
                read_model_info, str(props.get("model_path") or "")
            )
        if not self.enabled:
            info = self.model_info
            log.info(
                "llama-server has %d slots; model %s (%s%s)",
                len(slots),
                props.get("model_path"),
                info.model_class if info else "unknown",
                ": restores need --swa-full" if info and info.has_swa else "",
            )
        self.enabled = True
        self._last_props_check = time.monotonic()

    async def _notice_removals(self) -> None:
        gone = await self.store.forget_removed_async()
        if gone:
            log.info("%d cache entries were removed by another process (kvproxy rm/gc)", len(gone))

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_INTERVAL)
            try:
                if time.monotonic() - self._last_props_check > PROPS_CHECK_INTERVAL:
                    await self._notice_removals()
                    await self._discover()
                await self._evict()
                await self._idle_saves()
            except UpstreamError as exc:
                log.debug("housekeeping: %s", exc)
            except Exception:
                log.exception("housekeeping failed")

    async def _idle_saves(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        for slot in self.pool.slots:
            if (
                not slot.busy
                and self._worth_saving(slot)
                and now - slot.last_used >= self.settings.idle_save_after
            ):
                slot.busy = True  # single-threaded loop: nobody can take it between check and set
                try:
                    await self._verify(slot)
                    await self._save(slot)
                except UpstreamError as exc:
                    log.debug("idle save of slot %d: %s", slot.id, exc)
                finally:
                    self.pool.release(slot)

    # --- requests

    def _plan(self, payload: Any, headers: Any) -> Plan | str:
        """A Plan, or the reason this request is not cached."""
        if not isinstance(payload, dict):
            return "body is not a JSON object"
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return "no messages"
        n = payload.get("n", 1)
        if n not in (1, None):
            return "n > 1"
        tenant = keymod.tenant_of(headers, self.settings.tenant_header)
        ns = keymod.namespace(self.model_identity, payload, tenant)
        try:
            chain = keymod.chain(ns, messages)
        except keymod.UnkeyableRequest as exc:
            return str(exc)
        return Plan(payload, ns, chain, messages)

    async def handle_chat(self, request: web.Request, path_qs: str) -> web.StreamResponse:
        started = time.perf_counter()
        body = await request.read()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return error_response(400, f"Request body is not valid JSON: {exc}", "invalid_json")
        if not self.enabled and time.monotonic() - self._no_slots_seen > REDISCOVER_INTERVAL:
            with contextlib.suppress(UpstreamError):
                await self._discover()
        if not self.enabled or not isinstance(payload, dict):
            # Not an object: the server rejects it before it touches a slot.
            return await self._forward_unpinned(request, path_qs, body)
        plan = self._plan(payload, request.headers)
        if isinstance(plan, str):
            log.debug("not caching %s: %s", path_qs, plan)
            return await self._forward_pinned(request, path_qs, payload)

        try:
            slot, _ = await self.pool.acquire(plan.keys, plan.namespace)
        except QueueFull as exc:
            self._emit_request(
                RequestEvent(
                    request.path,
                    "miss",
                    503,
                    plan.keys[-1],
                    None,
                    0.0,
                    time.perf_counter() - started,
                )
            )
            return _busy(exc)
        queue_wait = time.perf_counter() - started
        lease = _Lease(self, [slot])
        try:
            decision, headers = await lease.guarded(self._prepare_or_miss(slot, plan))
            self.stats.requests[decision] += 1
            plan.payload["id_slot"] = slot.id
            capture = ReplyCapture(streaming=bool(plan.payload.get("stream")))
            try:
                result = await relay(
                    request,
                    self.upstream,
                    path_qs,
                    orjson.dumps(plan.payload),
                    body_replaced=True,
                    extra_headers=headers,
                    tap=capture.feed,
                )
            except BaseException:
                slot.forget()  # cut off mid-reply: the slot holds something we cannot name
                raise
            reply = capture.finish() if result.complete and result.status == 200 else None
            if decision == "restored":
                self._judge_restore(
                    plan.namespace, int(headers["X-KVProxy-Restored-Tokens"]), reply
                )
            # The client has its whole reply; the bookkeeping goes on without it.
            lease.hand_off(self._after_reply(slot, plan, reply))
            timings = (reply.timings if reply is not None else None) or {}
            event = RequestEvent(
                route=request.path,
                decision=decision,
                status=result.status,
                key=plan.keys[-1],
                slot=slot.id,
                queue_wait_s=queue_wait,
                duration_s=time.perf_counter() - started,
                restored_tokens=int(headers.get("X-KVProxy-Restored-Tokens", 0)),
                restore_ms=float(headers.get("X-KVProxy-Restore-Ms", 0.0)),
                cache_n=_int_or_none(timings.get("cache_n")),
                prompt_n=_int_or_none(timings.get("prompt_n")),
                prompt_ms=_float_or_none(timings.get("prompt_ms")),
            )
            if decision == "miss":
                # Explaining may read stored conversations (in a thread); the client may hang
                # up meanwhile, cancelling this handler, so it runs detached.
                self._spawn(self._emit_explained(event, plan, self._resident_texts(plan)))
            else:
                self._emit_request(event)
            return result.response
        finally:
            lease.release()

    async def _prepare_or_miss(self, slot: Slot, plan: Plan) -> tuple[str, dict[str, str]]:
        try:
            return await self._prepare(slot, plan)
        except UpstreamError as exc:
            # The cache could not do its part; the request still goes through, uncached.
            log.warning("cache preparation failed on slot %d: %s", slot.id, exc)
            slot.forget()
            return "miss", {"X-KVProxy-Cache": "miss"}

    async def handle_pinned(self, request: web.Request, path_qs: str) -> web.StreamResponse:
        body = await request.read()
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            payload = None
        if not self.enabled or not isinstance(payload, dict):
            return await self._forward_unpinned(request, path_qs, body)
        return await self._forward_pinned(request, path_qs, payload)

    async def _forward_pinned(
        self, request: web.Request, path_qs: str, payload: dict[str, Any]
    ) -> web.StreamResponse:
        """A slot-using request the cache does not key: pinned, so no slot changes behind us."""
        try:
            slot, _ = await self.pool.acquire()
        except QueueFull as exc:
            return _busy(exc)
        lease = _Lease(self, [slot])
        try:
            await lease.guarded(self._clear_for_foreign_use(slot))
            payload["id_slot"] = slot.id
            slot.forget()
            return (await self._relay_bypass(request, path_qs, orjson.dumps(payload))).response
        finally:
            lease.release()

    async def handle_unpinnable(self, request: web.Request, path_qs: str) -> web.StreamResponse:
        """Routes that ignore `id_slot` (e.g. /v1/messages): the server picks a slot itself, so
        the proxy holds all of them, saves what would be lost, and re-reads them afterwards."""
        body = await request.read()
        if not self.enabled:
            return await self._forward_unpinned(request, path_qs, body)
        try:
            taken = await self.pool.acquire_all()
        except QueueFull as exc:
            return _busy(exc)
        lease = _Lease(self, taken)
        try:
            for slot in taken:
                await lease.guarded(self._clear_for_foreign_use(slot))
            try:
                result = await self._relay_bypass(request, path_qs, body)
            except BaseException:
                for slot in taken:
                    slot.forget()
                raise
            lease.hand_off(self._reverify(taken))
            return result.response
        finally:
            lease.release()

    async def _reverify(self, slots: list[Slot]) -> None:
        for slot in slots:
            try:
                await self._verify(slot)
            except UpstreamError:
                slot.forget()

    async def _clear_for_foreign_use(self, slot: Slot) -> None:
        """Before a request the cache does not key uses the slot: keep what would be lost."""
        try:
            await self._verify(slot)
            if self._worth_saving(slot):
                await self._save(slot)
        except UpstreamError as exc:
            log.warning("could not save slot %d before a bypass request: %s", slot.id, exc)
            slot.forget()

    async def _forward_unpinned(
        self, request: web.Request, path_qs: str, body: bytes
    ) -> web.StreamResponse:
        return (await self._relay_bypass(request, path_qs, body)).response

    async def _relay_bypass(self, request: web.Request, path_qs: str, data: bytes) -> Any:
        self.stats.requests["bypass"] += 1
        started = time.perf_counter()
        result = await relay(
            request,
            self.upstream,
            path_qs,
            data,
            body_replaced=True,
            extra_headers={"X-KVProxy-Cache": "bypass"},
        )
        self._emit_request(
            RequestEvent(
                request.path, "bypass", result.status, duration_s=time.perf_counter() - started
            )
        )
        return result

    # --- getting the conversation into its slot

    def _learn_echo_style(self, slot: Slot, plan: Plan) -> None:
        """The request continues what the slot holds: see how the client echoed our reply."""
        holding = slot.holding
        if holding is None or not holding.messages:
            return
        n = len(holding.messages)
        if len(plan.messages) < n or slot.shared_depth(plan.keys, plan.namespace) < n:
            return
        style = canonical.observe_echo(holding.messages[-1], plan.messages[n - 1])
        if style is not None:
            self._echo_styles[plan.namespace] = style

    async def _learn_echo_style_from_disk(self, entry: Entry, plan: Plan) -> None:
        """As _learn_echo_style, for a conversation that came back from disk."""
        messages = await asyncio.to_thread(self.store.read_messages, entry.key)
        n = len(messages or [])
        if not messages or len(plan.messages) < n or plan.keys[n - 1] != entry.key:
            return
        style = canonical.observe_echo(messages[-1], plan.messages[n - 1])
        if style is not None:
            self._echo_styles[plan.namespace] = style

    async def _prepare(self, slot: Slot, plan: Plan) -> tuple[str, dict[str, str]]:
        self._learn_echo_style(slot, plan)
        verified = slot.holding is None or self.pool.still_as_seen(slot, SNAPSHOT_TRUST)
        if not verified:
            await self._verify(slot)
        resident = slot.shared_depth(plan.keys, plan.namespace)
        found = None
        if self.disk_enabled:
            found = self.store.lookup(plan.keys, plan.namespace)
            # Housekeeping applies the TTL every second; an entry that expired since then is
            # not restored either (a full eviction pass costs O(entries) per request).
            if found is not None and self.store.expired(found[0]):
                await self._evict()
                found = self.store.lookup(plan.keys, plan.namespace)
        if found is not None and found[1] > resident and plan.namespace not in self._restores_off:
            entry, _depth = found
            await self._verify(slot)  # a slot action follows: the slot must be idle
            if self._worth_saving(slot, plan.keys):
                await self._save(slot)
            restored = await self._restore(slot, entry)
            if restored is not None:
                if plan.namespace not in self._echo_styles:
                    self._spawn(self._learn_echo_style_from_disk(entry, plan))
                n_tokens, ms = restored
                return "restored", {
                    "X-KVProxy-Cache": "restored",
                    "X-KVProxy-Restored-Tokens": str(n_tokens),
                    "X-KVProxy-Restore-Ms": f"{ms:.1f}",
                }
            return "miss", {"X-KVProxy-Cache": "miss"}
        if resident > 0:
            return "resident", {"X-KVProxy-Cache": "resident"}
        if self._worth_saving(slot, plan.keys):
            await self._verify(slot)
            if self._worth_saving(slot, plan.keys):
                await self._save(slot)
        return "miss", {"X-KVProxy-Cache": "miss"}

    def _judge_restore(self, namespace: str, n_restored: int, reply: Any) -> None:
        """Did the server reuse what was restored? Some model/flag combinations never do
        (sliding-window models without --swa-full): then restoring only wastes I/O."""
        timings = (reply.timings if reply is not None else None) or {}
        if "cache_n" not in timings:
            return
        cache_n = int(timings["cache_n"])
        expected = min(n_restored, cache_n + int(timings.get("prompt_n", 0)) - 1)
        if cache_n >= expected // 2:
            self._ineffective_streak[namespace] = 0
            return
        self.stats.ineffective_restores += 1
        streak = self._ineffective_streak.get(namespace, 0) + 1
        self._ineffective_streak[namespace] = streak
        if streak >= INEFFECTIVE_LIMIT and namespace not in self._restores_off:
            self._restores_off.add(namespace)
            log.warning(
                "llama-server reused none of %d restored tokens (cache_n=%d), %d times in a "
                "row: kvproxy stops restoring for this model. Sliding-window models (Gemma, "
                "gpt-oss) need llama-server --swa-full; recurrent and hybrid models reuse a "
                "restore only when the next prompt extends it exactly.",
                n_restored,
                cache_n,
                streak,
            )

    def _worth_saving(self, slot: Slot, incoming: list[str] | None = None) -> bool:
        """Would the slot's content be lost, and is it worth keeping?

        Not when the incoming request continues it (it will hold a longer version), nor when
        only the last message differs (a regenerated reply).
        """
        holding = slot.holding
        if holding is None or slot.saved or not self.disk_enabled:
            return False
        if holding.namespace in self._restores_off:
            return False  # it would never be restored
        if holding.n_tokens < self.settings.min_tokens:
            return False
        if incoming is not None:
            shared = 0
            for mine, theirs in zip(holding.chain, incoming, strict=False):
                if mine != theirs:
                    break
                shared += 1
            if shared >= len(holding.chain) - 1:
                return False
        return True

    async def _verify(self, slot: Slot) -> None:
        """Trust the slot only if the server still shows what our last use left there."""
        deadline = time.monotonic() + BUSY_WAIT_LIMIT
        while True:
            info = await self._slot_info(slot.id)
            if not info.get("is_processing"):
                break
            # A cancelled request may still be winding down; a slot action now would be
            # deferred by the server, which can hang later requests.
            if time.monotonic() > deadline:
                raise UpstreamError(f"slot {slot.id} stays busy with work kvproxy did not send")
            await asyncio.sleep(0.02)
        snap = (info.get("id_task"), info.get("n_prompt_tokens"))
        if slot.holding is not None and snap != slot.snapshot:
            log.info(
                "slot %d changed behind kvproxy's back (%s -> %s): forgetting %s",
                slot.id,
                slot.snapshot,
                snap,
                slot.holding.key[:12],
            )
            self.stats.slot_resets_seen += 1
            slot.forget()
        slot.snapshot = snap
        slot.seen_at = time.monotonic()

    async def _slot_info(self, slot_id: int) -> dict[str, Any]:
        slots = await self.upstream.get_json("/slots")
        for info in slots:
            if info.get("id") == slot_id:
                return info
        raise UpstreamError(f"slot {slot_id} is not in GET /slots")

    async def _snapshot(self, slot: Slot) -> None:
        info = await self._slot_info(slot.id)
        slot.snapshot = (info.get("id_task"), info.get("n_prompt_tokens"))
        slot.seen_at = time.monotonic()
        if slot.holding is not None and isinstance(info.get("n_prompt_tokens"), int):
            slot.holding.n_tokens = info["n_prompt_tokens"]

    async def _save(self, slot: Slot) -> bool:
        """Save what the slot holds under its key. The slot must be ours (busy) and verified."""
        if slot.holding is not None and not slot.holding.canonical and slot.holding.messages:
            await self._make_canonical(slot)
        holding = slot.holding
        if holding is None:
            return False
        temp = self.store.temp_name(holding.key)
        started = time.perf_counter()
        try:
            res = await self.upstream.post_json(f"/slots/{slot.id}?action=save", {"filename": temp})
            n_saved = int(res["n_saved"])
            entry = Entry(
                key=holding.key,
                namespace=holding.namespace,
                n_tokens=n_saved,
                bytes=0,
                n_messages=holding.n_messages,
                created=time.time(),
                last_used=time.time(),
                chain=list(holding.chain),
                messages=list(holding.messages),
            )
            entry = await self.store.commit_async(entry, temp)
        except UpstreamError as exc:
            self.stats.save_failures += 1
            self._emit_action(SlotActionEvent("save", False, seconds=time.perf_counter() - started))
            await asyncio.to_thread(self.store.discard_temp, temp)
            if exc.status == 501:
                self.disk_enabled = False
                log.warning(
                    "llama-server has no --slot-save-path: disk cache off (start it with "
                    "--slot-save-path %s)",
                    self.settings.cache_dir,
                )
            else:
                self._disk_error(f"save of slot {slot.id} failed: {exc}")
            return False
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.stats.save_failures += 1
            self._emit_action(SlotActionEvent("save", False, seconds=time.perf_counter() - started))
            await asyncio.to_thread(self.store.discard_temp, temp)
            self._disk_error(f"committing save of slot {slot.id} failed: {exc}")
            return False
        slot.saved = True
        self.stats.saves += 1
        self.stats.saved_bytes += entry.bytes
        self._emit_action(
            SlotActionEvent("save", True, n_saved, entry.bytes, time.perf_counter() - started)
        )
        self._disk_error_logged = False
        log.info(
            "saved slot %d: %s, %d tokens, %d bytes in %.1f ms",
            slot.id,
            holding.key[:12],
            n_saved,
            entry.bytes,
            (time.perf_counter() - started) * 1000,
        )
        await self._evict()
        return True

    async def _make_canonical(self, slot: Slot) -> None:
        """Make the slot hold exactly the prefix the conversation's next request starts with
        (see canonical.py), so the saved state is reused on every model class. Best effort:
        when it cannot be done the slot is saved as it is."""
        holding = slot.holding
        assert holding is not None
        started = time.perf_counter()
        try:
            tokens = await canonical.prefix_tokens(
                self.upstream,
                holding.template,
                holding.messages,
                self._echo_styles.get(holding.namespace),
            )
        except (UpstreamError, ValueError) as exc:
            log.debug("no canonical prefix for %s: %s", holding.key[:12], exc)
            return
        if not tokens:
            return
        slot.started_at = time.monotonic()
        try:
            res = await self.upstream.post_json(
                "/completion",
                {"prompt": tokens, "n_predict": 0, "id_slot": slot.id, "cache_prompt": True},
            )
        except UpstreamError as exc:
            log.warning("evaluating the canonical prefix on slot %d failed: %s", slot.id, exc)
            await self._verify(slot)  # forgets the holding if the slot changed after all
            return
        await self._snapshot(slot)
        holding.canonical = True
        timings = res.get("timings") or {}
        log.debug(
            "slot %d: canonical prefix of %s is %d tokens (%s evaluated) in %.0f ms",
            slot.id,
            holding.key[:12],
            len(tokens),
            timings.get("prompt_n", "?"),
            (time.perf_counter() - started) * 1000,
        )

    def _disk_error(self, message: str) -> None:
        if not self._disk_error_logged:
            log.error("%s (further disk errors logged at debug level)", message)
            self._disk_error_logged = True
        else:
            log.debug(message)

    async def _restore(self, slot: Slot, entry: Entry) -> tuple[int, float] | None:
        """Load `entry` into the slot; on failure the entry is dropped and None returned."""
        self.store.pin(entry.key)
        try:
            problem = await asyncio.to_thread(self.store.check_state_file, entry)
            if problem is not None:
                log.warning("dropping cache entry %s: %s", entry.key[:12], problem)
                await self._drop(entry)
                return None
            started = time.perf_counter()
            try:
                res = await self.upstream.post_json(
                    f"/slots/{slot.id}?action=restore",
                    {"filename": self.store.state_name(entry.key)},
                )
            except UpstreamError as exc:
                # A failed restore erases the slot on the server.
                slot.forget()
                self.stats.restore_failures += 1
                self._emit_action(
                    SlotActionEvent("restore", False, seconds=time.perf_counter() - started)
                )
                if exc.status == 400:
                    log.warning("restore of %s failed, dropping it: %s", entry.key[:12], exc)
                    await self._drop(entry)
                    return None
                raise
            ms = (time.perf_counter() - started) * 1000
            n_restored = int(res.get("n_restored", 0))
            prev_task = slot.snapshot[0] if slot.snapshot else None
            slot.hold(
                Holding(entry.namespace, list(entry.chain), n_restored, entry.n_messages),
                saved=True,
            )
            # A restore leaves the slot's last task as it was; only the token count moves.
            slot.snapshot = (prev_task, n_restored if prev_task is not None else None)
            self.stats.restores += 1
            self.stats.restored_tokens += n_restored
            self._emit_action(SlotActionEvent("restore", True, n_restored, entry.bytes, ms / 1000))
            self._spawn(self.store.touch_async(entry.key))
            return n_restored, ms
        finally:
            self.store.unpin(entry.key)

    async def _drop(self, entry: Entry) -> None:
        await self.store.remove_async(entry)

    async def _evict(self) -> None:
        victims = self.store.select_victims()
        if victims:
            self.stats.evictions += len(victims)
            log.info("evicting %d cache entries", len(victims))
            await self.store.delete_files_async(victims)

    async def _after_reply(self, slot: Slot, plan: Plan, reply: Any) -> None:
        if reply is not None and reply.complete:
            echoed = reply.as_echoed(self.settings.keep_reasoning)
            chain = [*plan.keys, keymod.extend(plan.keys[-1], echoed)]
            timings = reply.timings or {}
            n_tokens = int(timings.get("cache_n", 0)) + int(timings.get("prompt_n", 0))
            self.stats.cache_n += int(timings.get("cache_n", 0))
            self.stats.prompt_n += int(timings.get("prompt_n", 0))
            slot.hold(
                Holding(
                    plan.namespace,
                    chain,
                    n_tokens,
                    len(plan.messages) + 1,
                    [*plan.messages, echoed],
                    canonical.template_fields(plan.payload),
                ),
                saved=False,
            )
        else:
            slot.forget()
        try:
            await self._snapshot(slot)
            if self.settings.write_through and self._worth_saving(slot):
                await self._save(slot)
        except Exception as exc:  # runs detached: nobody else would see it
            log.warning("after the reply on slot %d: %s", slot.id, exc)
            slot.forget()

    def _emit_request(self, event: RequestEvent) -> None:
        for listener in self.listeners:
            try:
                listener.on_request(event)
            except Exception:
                log.exception("request listener %r failed", listener)

    def _emit_action(self, event: SlotActionEvent) -> None:
        for listener in self.listeners:
            try:
                listener.on_slot_action(event)
            except Exception:
                log.exception("slot-action listener %r failed", listener)

    async def _emit_explained(
        self, event: RequestEvent, plan: Plan, candidates: list[tuple[str, list[Any]]]
    ) -> None:
        event.miss = await self._explain_miss(plan, candidates)
        self._emit_request(event)

    def _resident_texts(self, plan: Plan) -> list[tuple[str, list[Any]]]:
        """The conversations in slots, same namespace only (so never another tenant's).
        Taken before the reply's bookkeeping replaces what the request's slot held."""
        return [
            (f"slot {slot.id}", slot.holding.messages)
            for slot in self.pool.slots
            if slot.holding is not None
            and slot.holding.namespace == plan.namespace
            and slot.holding.messages
        ]

    async def _explain_miss(
        self, plan: Plan, candidates: list[tuple[str, list[Any]]]
    ) -> MissExplanation | None:
        """Which known conversation of the same namespace this request came closest to:
        `candidates` (from slots), and the most recently used stored ones."""
        try:
            # Slots first: a conversation that keeps missing (a timestamp in its system prompt)
            # is usually still in one, and then no stored text needs reading for every miss.
            found = explain_miss(plan.messages, candidates) if candidates else None
            stored = self.store.recent_with_text(plan.namespace) if found is None else []
            if stored:
                texts = await asyncio.to_thread(self.store.read_many_messages, stored)
                found = explain_miss(plan.messages, [(f"disk {k[:12]}", m) for k, m in texts])
            return found
        except Exception:
            log.exception("explaining a miss failed")
            return None

    def _spawn(self, coro: Any) -> None:
        self._track(asyncio.ensure_future(coro))

    def _track(self, task: asyncio.Future[Any]) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def snapshot_stats(self) -> dict[str, Any]:
        return {
            **self.stats.__dict__,
            "enabled": self.enabled,
            "disk_enabled": self.disk_enabled,
            "model_class": self.model_info.model_class if self.model_info else "unknown",
            "entries": len(self.store.entries),
            "disk_bytes": self.store.total_bytes,
            "queue_waiting": self.pool.waiting,
            "slots": [
                {
                    "id": s.id,
                    "busy": s.busy,
                    "key": s.holding.key if s.holding else None,
                    "n_tokens": s.holding.n_tokens if s.holding else 0,
                    "saved": s.saved,
                }
                for s in self.pool.slots
            ],
        }


class _Lease:
    """The slots one request holds. Slot work it starts (saves, restores, bookkeeping) must
    finish even if the client hangs up, so that work, once started, releases the slots."""

    def __init__(self, cache: ConversationCache, slots: list[Slot]) -> None:
        self.cache = cache
        self.slots = slots
        self.released = False

    async def guarded(self, coro: Coroutine[Any, Any, _T]) -> _T:
        task = asyncio.ensure_future(coro)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            self._release_after(task)
            raise

    def hand_off(self, coro: Coroutine[Any, Any, Any]) -> None:
        self._release_after(asyncio.ensure_future(coro))

    def _release_after(self, task: asyncio.Future[Any]) -> None:
        if self.released:
            return
        self.released = True
        self.cache._track(task)
        task.add_done_callback(lambda _t: self._free())

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._free()

    def _free(self) -> None:
        for slot in self.slots:
            self.cache.pool.release(slot)


def _busy(exc: QueueFull) -> web.Response:
    return error_response(
        503,
        f"All llama-server slots are busy: {exc}. Retry shortly.",
        "slots_busy",
        headers={"Retry-After": str(exc.retry_after)},
    )


def _int_or_none(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) else None


def _float_or_none(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _model_identity(props: dict[str, Any]) -> str:
    """Which model and KV layout produced a state: states of another never match."""
    path = str(props.get("model_path", ""))
    parts = [path, str((props.get("default_generation_settings") or {}).get("n_ctx", ""))]
    try:
        st = os.stat(path)
        parts += [str(st.st_size), str(int(st.st_mtime))]
    except OSError:
        pass
    return "|".join(parts)
