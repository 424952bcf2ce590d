"""One llama-server: its client, its slot pool, and the identity of the model it serves.

Discovery asks the server what it is (GET /props) and whether slots can be pinned
(GET /slots). A server whose model or slot count changed invalidates everything kvproxy
knew about its slots; one that refuses GET /slots is served uncached.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

from kvproxy import keys
from kvproxy.cache.servers.liveness import Liveness, no_answer
from kvproxy.cache.servers.loras import NamespaceLoras
from kvproxy.cache.servers.slotpool import QueueFull, SlotPool
from kvproxy.config import Settings
from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.server import localproc, probe
from kvproxy.server.api import LlamaClient, ModelRoute
from kvproxy.server.fingerprint import Fingerprint, Fingerprinter, managed_args
from kvproxy.server.modelinfo import ModelInfo, model_identity, read_model_info, swa_note
from kvproxy.server.modellist import is_router

log = logging.getLogger("kvproxy.cache")

# Routes the server serves on slots it picks itself (they ignore `id_slot`), each with the
# route that probes whether the server serves that kind at all. An embedding or rerank task
# takes a slot and replaces its cached prompt (server-context.cpp: stateless tasks start from
# n_past 0), a transcription is a completion: served, they hold every slot (unkeyed.py). A
# server not started for them (no --embeddings, --reranking, audio model) answers 501 at
# once without a task: then they pass straight through, never queued behind every slot.
# Probed when such a request comes, at most every PROPS_CHECK_INTERVAL.
SLOT_PICKING_ROUTES = {
    "/embedding": "/embeddings",
    "/embeddings": "/embeddings",
    "/v1/embeddings": "/embeddings",
    "/rerank": "/rerank",
    "/reranking": "/rerank",
    "/v1/rerank": "/rerank",
    "/v1/reranking": "/rerank",
    "/audio/transcriptions": "/v1/audio/transcriptions",
    "/v1/audio/transcriptions": "/v1/audio/transcriptions",
}
# Statuses of a request the server refused without a slot.
REFUSED_STATUSES = frozenset({404, 501})

# How often a running proxy checks that the server is still the one it knows.
PROPS_CHECK_INTERVAL = 15.0
# How long a request waits for the fingerprint of a server seen starting (then goes uncached).
READ_WAIT = 30.0
# While the server refuses GET /slots (caching off), how often a request may look again.
REDISCOVER_INTERVAL = 1.0


# With several servers, how often each is checked: one that died leaves rotation within
# this (a request that finds it unreachable takes it out at once), one that returns rejoins.
SEVERAL_CHECK_INTERVAL = 2.0
# With several servers, how long a check waits for GET /props (which a healthy server answers
# at once, even mid-decode): a server stopped (SIGSTOP) or wedged accepts connections and never
# answers, and must leave rotation within seconds, not after the 30 s of a lone server's
# check, while the others serve the new conversations.
SEVERAL_CHECK_TIMEOUT = 5.0


class Backend:
    """`model`: one model of a router-mode server (a lane of its own, reached by name; one
    the router has not loaded answers its GETs 400 and counts as down meanwhile)."""

    def __init__(
        self,
        upstream: Upstream,
        settings: Settings,
        several: bool = False,
        model: str | None = None,
    ) -> None:
        self.upstream = upstream
        self.managed = bool(settings.model or settings.models_dir)  # kvproxy started it
        # One of several servers: checked more often, and distrusted when it returns (its
        # requests went elsewhere meanwhile; it may have been restarted, empty).
        self.several = several or model is not None
        self.check_interval = SEVERAL_CHECK_INTERVAL if self.several else PROPS_CHECK_INTERVAL
        self.model = model
        self.client = LlamaClient(upstream, ModelRoute(model) if model else None)
        self.pool = SlotPool(1, settings.max_queue, settings.queue_timeout)
        self.enabled = False  # slot pinning works (GET /slots answered)
        self.slot_actions = True  # slot save/restore works (--slot-save-path set)
        # The cache dir is open (the cache sets it false while it opens): until then nothing
        # discovers the server, so requests pass through uncached.
        self.store_open = True
        self.model_identity = ""
        self.model_info: ModelInfo | None = None
        # What the server computes KV with (server/fingerprint.py), read at each start seen.
        self.fingerprinter = Fingerprinter(
            self.client,
            upstream.base_url,
            settings.cache_dir,
            model,
            managed_args(settings) if model is None else None,
        )
        self.fingerprint: Fingerprint | None = None
        self.identity = keys.Identity("")  # what requests are keyed under
        self.loras = NamespaceLoras()  # each namespace's adapter scales (evaluations use them)
        # One name per start of the server seen (`life_started`: when), for what holds only
        # while it runs (the restore guard's proofs, entries it refused).
        self.life = ""
        self._lives = 0
        self.life_started = 0.0
        # Why saves and restores are paused (a file the server loaded changed on disk: the
        # next start loads other content), None while they are not.
        self.doubt: str | None = None
        self._reading: asyncio.Event | None = None  # set when a fingerprint read ends
        self._last_props_check = 0.0
        # Probe route (SLOT_PICKING_ROUTES) -> (the server refuses it, when that was seen).
        self._refusals: dict[str, tuple[bool, float]] = {}
        # When a server that answered /props last refused GET /slots: requests then look again
        # at most every REDISCOVER_INTERVAL. A server that was not up is asked at once.
        self._no_slots_seen = 0.0
        # Why the last look found no server (GET /props failed): None once one answered.
        self.down: UpstreamError | None = None
        self.sleeping = False  # the server's /props said `is_sleeping` (--sleep-idle-seconds)
        # The server's own /props said it is a router: its models get lanes (models.py).
        self.router = False
        # A request could not reach the server: what its slots held is distrusted once it
        # answers again (it may have been restarted, empty).
        self._lost = False
        # Whether its last look got no answer at all: requests waiting on it go elsewhere.
        self.liveness = Liveness()

    def refuses_slot_actions(self) -> None:
        """The server answered a slot action 501 (no --slot-save-path): no saves or restores."""
        self.slot_actions = False

    @property
    def disk_enabled(self) -> bool:
        """Saves and restores may be done: the server has slot actions, and kvproxy knows what
        it computes with."""
        return self.slot_actions and self.doubt is None

    def store_opening(self, opening: bool) -> None:
        """While the cache dir opens, nothing discovers the server: requests pass through."""
        self.store_open = not opening

    @property
    def name(self) -> str:
        """The server's address (host:port, then /model for a router's), as logs, metrics
        and stats name it."""
        address = self.upstream.base_url.split("://", 1)[-1]
        return f"{address}/{self.model}" if self.model else address

    @property
    def model_name(self) -> str:
        """The model as `kvproxy ls` and the stats name it: a router's model by its name,
        else the server's GGUF file by its file name ("" before the server was seen)."""
        if self.model is not None:
            return self.model
        return self.model_info.path.name if self.model_info is not None else ""

    @property
    def label(self) -> str | None:
        """The server's name where a request's report names it: only among several."""
        return self.name if self.several else None

    @property
    def model_class(self) -> str:
        return self.model_info.model_class if self.model_info else "unknown"

    def props_check_due(self) -> bool:
        if self.fingerprint is not None and not self.fingerprint.probed:
            return True  # its behavioural probe failed: read it again at once
        return time.monotonic() - self._last_props_check > self.check_interval

    def unreachable(self, reason: str) -> None:
        """A request could not reach the server (with several, it goes to another): out of
        rotation until the server answers a look again, and its slots distrusted then."""
        self.down = UpstreamError(reason)
        self.enabled = False
        self._lost = True

    async def restarted_unseen(self, why: str) -> None:
        """The server may have started again unseen (a slot says so; not when its process is
        the same: a wake from sleep empties slots): read again at once, disk paused till then."""
        proc = self.fingerprint.process if self.fingerprint is not None else None
        if proc is not None and await asyncio.to_thread(localproc.same_process, proc):
            return
        if self.doubt is None:
            log.warning("llama-server %s started again (%s): reading it again", self.name, why)
        self.doubt, self._lost = why, True
        self._last_props_check = 0.0  # housekeeping's next tick looks

    def model_gone(self, why: str) -> None:
        """The router unloaded this model, or it fell asleep: its KV went with it. What the
        slots held is forgotten now (a saved copy is restored when it comes back), and once
        more when it answers again."""
        log.info("model %s %s: its slots are forgotten", self.model, why)
        for slot in self.pool.slots:
            if not slot.busy:
                slot.forget()
        self._lost = True

    async def rediscover_if_off(self, wake: bool = True) -> None:
        """Called per request while caching is off: a server that came up is used at once.
        `wake`: the request will wake a sleeping server anyway (a health check would not)."""
        if not self.store_open:
            return
        if self._reading is not None:  # its fingerprint is being read: the request waits
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._reading.wait()), READ_WAIT)
        if not self.enabled and time.monotonic() - self._no_slots_seen > REDISCOVER_INTERVAL:
            try:
                await self.discover(wake=wake)
            except UpstreamError:
                pass

    async def discover(self, wake: bool = False) -> None:
        """Look at the server. GET /props neither wakes a server asleep (--sleep-idle-seconds)
        nor counts as activity that keeps it awake; GET /slots does both. So /slots is read
        only when caching is off, or /props shows another server (model, slot count, slots
        endpoint), or `wake` (a request is coming that wakes it anyway); never while it sleeps
        unless `wake`."""
        # Every attempt counts as the check, failed ones too: housekeeping's 15 s work (the
        # props check, noticing removals) must not run every second while the server is down.
        self._last_props_check = time.monotonic()
        try:
            props = await self.client.props(SEVERAL_CHECK_TIMEOUT if self.several else 30.0)
        except UpstreamError as exc:
            self.down = exc
            self._lost = self._lost or self.several
            if no_answer(exc):
                self.liveness.found_hung()
            raise
        self.down = None
        self.liveness.answered()
        self.router = self.model is None and is_router(props)
        lost = self._lost  # it may have started again meanwhile, whatever /props says
        if self._lost:
            self._lost = False
            log.info(
                "llama-server %s answers again: its slots are distrusted", self.upstream.base_url
            )
            for slot in self.pool.slots:
                if not slot.busy:
                    slot.forget()
        if self._notice_sleep(props) and not wake:
            return
        known = self.fingerprint
        same = known is not None and not lost and await self.fingerprinter.same_server(known, props)
        same = same and known is not None and known.probed  # else its probe failed: again
        if (
            not wake
            and self.enabled
            and same
            and props.get("total_slots", len(self.pool.slots)) == len(self.pool.slots)
            and props.get("endpoint_slots", True) is not False
        ):
            assert known is not None
            await self._watch_files(known)
            return  # the server kvproxy knows
        try:
            slots = await self.client.slots()
        except UpstreamError as exc:
            identity = await asyncio.to_thread(model_identity, props)
            if self.enabled or self.model_identity != identity:
                log.warning("GET /slots failed (%s): caching is off, requests pass through", exc)
            self._no_slots_seen = time.monotonic()
            self.enabled = False
            self.model_identity = identity
            self.fingerprint = None
            return
        if not same or len(slots) != len(self.pool.slots):
            await self._started(props, len(slots))
        self.pool.seen_empty(slots)
        if not self.enabled:
            info = self.model_info
            log.info(
                "llama-server has %d slots; model %s (%s%s)",
                len(slots),
                props.get("model_path"),
                self.model_class,
                swa_note(info, self.managed),
            )
        self.enabled = True
        self._last_props_check = time.monotonic()

    async def _started(self, props: dict[str, Any], n_slots: int) -> None:
        """A server seen for the first time, changed, or started again: what it computes
        with is read again (saves and restores wait for it); what its slots held is
        forgotten if that changed (else its slots are checked before they are trusted)."""
        self.pool.resize(n_slots)
        self.pool.started_again()
        paused, self.doubt = self.doubt, "reading llama-server's fingerprint"
        self._reading = reading = asyncio.Event()
        try:
            fp = await self.fingerprinter.read(props, self._probe)
        except BaseException:
            self.doubt, self.fingerprint = paused, None  # the next look reads it again
            raise
        finally:
            self._reading = None
            reading.set()
        known = self.fingerprint
        if not fp.probed and known is not None and known.config == fp.config:
            fp = replace(fp, text=known.text)  # keyed as before till the probe tells (no disk)
        if fp.text != self.model_identity:
            log.info("llama-server %s computes with %s", self.name, fp.text)
            self.pool.forget_all()
            self._refusals.clear()
            self.loras.clear()  # requests on their way were read under what it was
            self.model_info = await asyncio.to_thread(
                read_model_info, fp.text.split("|", 1)[0] or str(props.get("model_path") or "")
            )
        self.fingerprint = fp
        self.model_identity = fp.text
        self.identity = keys.Identity(fp.text, fp.lora_defaults)
        self._lives += 1
        self.life = f"{self.name}#{self._lives}"
        self.life_started = time.time()
        if not fp.probed:  # read again at the next look (props_check_due), at once
            self.doubt = "its behavioural probe did not run"
            return
        if paused is not None:
            log.info("llama-server started again: saves and restores resume")
        self.doubt = None

    async def _watch_files(self, known: Fingerprint) -> None:
        """A file the running server loaded changed on disk: it computes with the new content
        once it starts again, which kvproxy may not see. Saves and restores pause till then."""
        changed = [] if self.doubt else await self.fingerprinter.changed_files(known)
        if changed:
            self.doubt = f"{changed[0]} changed on disk"
            why = "saves and restores pause until it starts again"
            log.warning("%s while llama-server %s runs: %s", self.doubt, self.name, why)

    async def _probe(self) -> probe.Behaviour | None:
        """The behavioural probe, on a slot taken from the pool and then forgotten."""
        try:
            slot, _ = await self.pool.acquire()
        except QueueFull as exc:
            raise UpstreamError(f"no idle slot: {exc}") from exc
        try:
            return await probe.behaviour(self.client, slot.id)
        finally:
            slot.forget()
            self.pool.release(slot, used=False)

    def _notice_sleep(self, props: dict[str, Any]) -> bool:
        """Whether the server is asleep, as /props says. Falling asleep it unloads the model
        and its KV: what kvproxy knew the slots held is gone (they are empty once it wakes)."""
        asleep = props.get("is_sleeping") is True
        if asleep and not self.sleeping:
            log.info("llama-server is asleep: its slots were emptied; watching without waking it")
            for slot in self.pool.slots:
                if not slot.busy:
                    slot.forget()
        elif self.sleeping and not asleep:
            log.info("llama-server woke up")
        self.sleeping = asleep
        return asleep

    async def asleep(self) -> bool:
        """Ask the server (GET /props, which does not wake it) whether it sleeps now."""
        try:
            return self._notice_sleep(await self.client.props())
        except UpstreamError:
            return False

    def not_ready(self) -> UpstreamError | None:
        """With caching off because no server answered GET /props: why, when the client would
        get an error from the server at this moment (a loading server's 503, or no answer),
        so that no slot-using request goes unpinned to a server that comes up in between
        (handlers/answers.py words it). None when the request may go as it is (pinned, or
        uncached by design)."""
        if self.enabled or self.down is None or not self.store_open:
            return None
        if self.down.status == 503 or self.down.status is None:
            return self.down
        return None

    async def refuses(self, path: str) -> bool:
        """Whether the server answers `path` without a slot (see SLOT_PICKING_ROUTES)."""
        probe = SLOT_PICKING_ROUTES.get(path)
        if probe is None:
            return False
        known = self._refusals.get(probe)
        if known is None or time.monotonic() - known[1] > PROPS_CHECK_INTERVAL:
            known = (await self.client.refuses(probe), time.monotonic())
            self._refusals[probe] = known
        return known[0]

    def served(self, path: str) -> None:
        """The server served `path` after all (restarted for it since it was probed)."""
        probe = SLOT_PICKING_ROUTES.get(path)
        if probe is not None:
            self._refusals[probe] = (False, time.monotonic())
