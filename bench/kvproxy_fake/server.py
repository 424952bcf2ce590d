"""A fake llama-server for fast tests and for the `overhead` benchmark.

It reproduces the behaviour of the real server that kvproxy depends on (see
tools/server/server-context.cpp of llama.cpp): slot selection and id wrapping, the
deferral of work sent to busy slots (including the way deferred tasks are popped again),
prompt-cache reuse and `timings`, the slot save file format, restore failures erasing the
slot, the reuse rules of SWA and recurrent models after a restore, SSE chunking and the
error JSON shape. Tokens are bytes, so tests can reason about token counts exactly (the
fake model: model.py; the JSON of each endpoint's replies: replies.py; the slot save file
format: state.py).

In-process: `async with FakeLlamaServer(...) as fake:` (tests). As a process, answering at once:
`python -m kvproxy_fake.server --port P [--no-slots] [--ignore-eos]` (benchmarks). The
proxy runtime never imports this module.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import itertools
import json
import signal
import socket
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from aiohttp import web
from aiohttp.typedefs import Handler

from kvproxy_fake.model import (
    EOS,
    N_VOCAB,
    REASONING_TEXT,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_ARGUMENTS,
    TOOL_CLOSE,
    TOOL_OPEN,
    TOOL_TRIGGER,
    Json,
    RequestError,
    common_prefix,
    content_text,
    default_reply,
    detokenize,
    error_json,
    error_response,
    render_chat,
    token_bytes,
    tokenize,
    tokenize_mixed,
)
from kvproxy_fake.replies import (
    ChatFormat,
    CompletionFormat,
    Format,
    Job,
    OaiCompletionFormat,
    Run,
    sse,
)
from kvproxy_fake.state import (
    BAD_FILE,
    SIDECAR_SUFFIX,
    decode_state,
    encode_sidecar,
    encode_state,
    validate_filename,
)

N_BATCH = 512
SLOT_PROMPT_SIMILARITY = 0.1

# What the API key middleware lets through (server-http.cpp): health checks and the UI's root.
PUBLIC_PATHS = frozenset({"/health", "/v1/health", "/"})
# What the server-state middleware answers while the model loads (the rest get a 503).
LOADING_PATHS = frozenset({"/models", "/v1/models", "/api/tags"})
# What a sleeping server answers without waking up (seen on llama-server with
# --sleep-idle-seconds: these leave it asleep; /slots, /tokenize, /apply-template, slot actions
# and completions wake it).
NO_WAKE_PATHS = frozenset({"/health", "/v1/health", "/props", "/models", "/v1/models"})
# The pre-routing handler's answer to any OPTIONS (a CORS preflight), before the key check.
CORS_PREFLIGHT = {
    "Access-Control-Allow-Credentials": "true",
    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
    "Access-Control-Allow-Headers": "*",
}

Reuse = Literal["full", "none", "extend", "window"]
ReplyFn = Callable[[list[dict[str, Any]]], str]


# --------------------------------------------------------------------------- slots


@dataclass
class Hold:
    """Tests: requests to one route wait while `gate` is set and not yet open, counted."""

    gate: asyncio.Event | None = None
    waiting: int = 0

    async def passed(self) -> None:
        if self.gate is not None:
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1


@dataclass(eq=False)
class FakeSlot:
    id: int
    n_ctx: int
    tokens: list[int] = field(default_factory=list)
    id_task: int | None = None
    is_processing: bool = False
    restored: bool = False
    # reuse="window": tokens that came from a restore and are still in the slot.
    restored_n: int = 0
    t_last_used: float = -1.0
    n_prompt_processed: int = 0
    n_prompt_cached: int = 0
    n_decoded: int = 0
    n_predict: int = -1
    params: Json = field(default_factory=dict)

    def clear(self) -> None:
        self.tokens = []
        self.restored = False
        self.restored_n = 0

    def to_json(self) -> Json:
        out: Json = {
            "id": self.id,
            "n_ctx": self.n_ctx,
            "speculative": False,
            "is_processing": self.is_processing,
        }
        if self.id_task is not None:
            n_remain = -1 if self.n_predict < 0 else self.n_predict - self.n_decoded
            out.update(
                id_task=self.id_task,
                n_prompt_tokens=len(self.tokens),
                n_prompt_tokens_processed=self.n_prompt_processed,
                n_prompt_tokens_cache=self.n_prompt_cached,
                params=self.params,
                next_token=[
                    {
                        "has_next_token": self.is_processing,
                        "has_new_line": False,
                        "n_remain": n_remain,
                        "n_decoded": self.n_decoded,
                    }
                ],
            )
        return out


@dataclass(eq=False)
class _Ticket:
    """A task waiting in the server's queue: a completion or a slot action."""

    id_slot: int  # the task's id_slot (-1 = any); deferred tasks are matched on it
    prompt: list[int]
    future: asyncio.Future[Any]
    action: Callable[[FakeSlot], tuple[int, Json]] | None = None
    target: int | None = None  # slot index of a slot action (its id_slot stays -1)


def _wrap(id_slot: int, n_slots: int) -> int:
    # the server computes `id_slot % slots.size()` with an unsigned size: -1 wraps too
    return (id_slot % 2**64) % n_slots


# --------------------------------------------------------------------------- server


# How long after a streamed reply's last chunk the connection closes (llama-server: at once; a
# client that sends its next request on it first loses it).
STREAM_CLOSE_S = 0.0


class FakeLlamaServer:
    """In-process fake of llama-server. Use `await start()`/`await stop()` or `async with`."""

    def __init__(
        self,
        *,
        n_slots: int = 2,
        slot_save_path: Path | None = None,
        n_ctx: int = 4096,
        prompt_delay: float = 0.0,
        token_delay: float = 0.0,
        write_sidecar: bool = False,
        api_key: str | None = None,
        model_path: str = "/models/fake-model.gguf",
        reuse: Reuse = "full",
        window: int = 512,
        wipe_idle_slots: bool = False,
        reply: ReplyFn | None = None,
        fail_saves: bool = False,
        action_delay: float = 0.0,
        end_delay: float = 0.0,
        slots_endpoint: bool = True,
        ignore_eos: bool = False,
        sleep_idle_seconds: float | None = None,
    ) -> None:
        if reuse not in ("full", "none", "extend", "window"):
            raise ValueError(f"unknown reuse rule {reuse!r}")
        self.n_slots = n_slots
        self.slot_save_path = Path(slot_save_path) if slot_save_path is not None else None
        self.n_ctx = n_ctx
        self.prompt_delay = prompt_delay
        self.token_delay = token_delay
        self.write_sidecar = write_sidecar
        self.api_key = api_key
        self.model_path = model_path
        self.model_name = Path(model_path).name
        self.reuse: Reuse = reuse
        # reuse="window" (SWA with --swa-full): restored tokens serve a divergence only within
        # the last `window` of them, for as long as they stay in the slot.
        self.window = window
        self.wipe_idle_slots = wipe_idle_slots
        self.reply: ReplyFn = reply or default_reply
        # Faults the real server shows only on a full disk / a slow disk.
        self.fail_saves = fail_saves
        self.action_delay = action_delay
        self.end_delay = end_delay
        # llama-server's --no-slots: GET /slots answers 501, so kvproxy passes requests through.
        self.slots_endpoint = slots_endpoint
        # llama-server's --ignore-eos: every reply runs to its token limit (or the context's end).
        self.ignore_eos = ignore_eos
        # Tests: the server is still loading its model (it answers 503 but to /models).
        self.loading = False
        self._thawed = asyncio.Event()  # cleared (`frozen`): every request waits, unanswered
        self._thawed.set()
        # llama-server's --sleep-idle-seconds: idle that long, it unloads the model and its KV
        # (`is_sleeping` in /props); a request but those in NO_WAKE_PATHS reloads it, empty.
        self.sleep_idle_seconds = sleep_idle_seconds
        self.wakes = 0
        self._last_active = time.monotonic()
        # Tests: GET /slots held (the server's loop busy elsewhere), POST /apply-template held
        # (a render that takes its time).
        self.slots_hold = Hold()
        self.template_hold = Hold()
        # Tests: the slot is wiped (as a unified KV cache wipes idle slots) just before a save.
        self.wipe_before_save = False

        self.slots = [FakeSlot(id=i, n_ctx=n_ctx) for i in range(n_slots)]
        self.requests: list[tuple[str, str, Any]] = []
        self.actions: list[tuple[str, int, str | None, bool]] = []
        self.deferred_actions = 0
        self.deferred_tasks = 0
        self.url = ""
        self._deferred: list[_Ticket] = []
        self._next_id = 0
        self._runner: web.AppRunner | None = None

    @property
    def save_dir(self) -> Path:
        """`slot_save_path` of a server started with one (the tests' and benchmarks' case)."""
        if self.slot_save_path is None:
            raise RuntimeError("this fake server has no --slot-save-path")
        return self.slot_save_path

    @property
    def frozen(self) -> bool:
        return not self._thawed.is_set()

    @frozen.setter
    def frozen(self, value: bool) -> None:
        if value:
            self._thawed.clear()
        else:
            self._thawed.set()

    # ----------------------------------------------------------------- lifecycle

    async def start(self, port: int = 0) -> str:
        """Listen on 127.0.0.1:`port` (0: any free port); returns the base URL."""
        app = web.Application(middlewares=[self._middleware])
        r = app.router
        r.add_get("/health", self._health)
        r.add_get("/v1/health", self._health)
        r.add_get("/props", self._props)
        r.add_get("/models", self._models)
        r.add_get("/v1/models", self._models)
        r.add_post("/tokenize", self._tokenize)
        r.add_post("/detokenize", self._detokenize)
        r.add_post("/apply-template", self._apply_template)
        r.add_post("/completion", self._completion)
        r.add_post("/completions", self._completion)
        r.add_post("/v1/completions", self._completion_oai)
        r.add_post("/chat/completions", self._chat)
        r.add_post("/v1/chat/completions", self._chat)
        r.add_get("/slots", self._get_slots)
        r.add_post("/slots/{id_slot}", self._post_slot)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # A fake restarted on its old port (a server that died and came back) binds at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        for ticket in self._deferred:
            ticket.future.cancel()
        self._deferred.clear()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> FakeLlamaServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ----------------------------------------------------------------- scheduling

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id

    def _pick_slot(self, ticket: _Ticket) -> FakeSlot | None:
        """get_available_slot(): a pinned slot (maybe busy), else LCP similarity, else LRU."""
        if ticket.target is not None:
            return self.slots[ticket.target]
        if ticket.id_slot != -1:
            return self.slots[_wrap(ticket.id_slot, self.n_slots)]
        best, f_best = None, 0.0
        for slot in self.slots:
            if slot.is_processing or not slot.tokens or not ticket.prompt:
                continue
            f_sim = common_prefix(slot.tokens, ticket.prompt) / len(ticket.prompt)
            if f_sim > f_best and f_sim > SLOT_PROMPT_SIMILARITY:
                best, f_best = slot, f_sim
        if best is not None:
            return best
        t_last = -1.0
        for slot in self.slots:
            if not slot.is_processing and (best is None or slot.t_last_used <= t_last):
                best, t_last = slot, slot.t_last_used
        return best

    def _try_run(self, ticket: _Ticket) -> bool:
        slot = self._pick_slot(ticket)
        if slot is None or slot.is_processing:
            return False
        if ticket.action is not None:
            ticket.future.set_result(ticket.action(slot))
            return True
        slot.is_processing = True
        if self.wipe_idle_slots:
            for other in self.slots:
                if not other.is_processing:
                    other.clear()
        ticket.future.set_result(slot)
        return True

    def _defer(self, ticket: _Ticket) -> None:
        self._deferred.append(ticket)
        if ticket.action is not None:
            self.deferred_actions += 1
        else:
            self.deferred_tasks += 1

    async def _submit(self, ticket: _Ticket) -> Any:
        if not self._try_run(ticket):
            self._defer(ticket)
        try:
            return await ticket.future
        except asyncio.CancelledError:
            if ticket in self._deferred:
                self._deferred.remove(ticket)
            fut = ticket.future
            if ticket.action is None and fut.done() and not fut.cancelled():
                self._release(fut.result())
            raise

    def _release(self, slot: FakeSlot) -> None:
        """server_slot::release() then server_queue::pop_deferred_task(slot.id)."""
        if not slot.is_processing:
            return
        slot.is_processing = False
        slot.t_last_used = time.monotonic()
        slot.n_prompt_processed = slot.n_prompt_cached = slot.n_decoded = 0
        slot.n_predict = -1
        if not self._deferred:
            return
        ticket = next((t for t in self._deferred if t.id_slot == slot.id), self._deferred[0])
        self._deferred.remove(ticket)
        if ticket.future.done():
            return
        if not self._try_run(ticket):
            self._defer(ticket)

    # ----------------------------------------------------------------- middleware

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        body: Any = None
        if request.can_read_body:
            raw = await request.read()
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw.decode(errors="replace")
        self.requests.append((request.method, request.path_qs, body))
        await self._thawed.wait()  # as a SIGSTOPped server: connections accepted, no answer
        if request.method == "OPTIONS":
            origin = {"Access-Control-Allow-Origin": request.headers.get("Origin", "")}
            return web.Response(
                body=b"", content_type="text/html", headers={**origin, **CORS_PREFLIGHT}
            )
        if self.loading and request.path not in LOADING_PATHS:
            return error_response("Loading model", "unavailable_error")
        if self.api_key is not None and request.path not in PUBLIC_PATHS:
            key = request.headers.get("Authorization") or request.headers.get("X-Api-Key") or ""
            key = key.removeprefix("Bearer ")
            if key != self.api_key:
                return error_response("Invalid API Key", "authentication_error")
        wakes = request.path not in NO_WAKE_PATHS
        if wakes and self.is_sleeping:
            self.wakes += 1
            for slot in self.slots:  # the model and its context are loaded again: empty
                slot.clear()
                slot.id_task = None
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
            return error_response("File Not Found", "not_found_error")
        except RequestError as err:
            return error_response(err.message, err.kind, **err.extra)
        finally:
            if wakes:
                self._last_active = time.monotonic()

    @property
    def is_sleeping(self) -> bool:
        idle = time.monotonic() - self._last_active
        return (
            self.sleep_idle_seconds is not None
            and idle > self.sleep_idle_seconds
            and not any(slot.is_processing for slot in self.slots)
        )

    @staticmethod
    async def _body(request: web.Request) -> Json:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else {}
        except ValueError as err:
            raise RequestError(f"[json.exception.parse_error] {err}") from err
        if not isinstance(body, dict):
            raise RequestError("request body must be a JSON object")
        return body

    # ----------------------------------------------------------------- simple routes

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _props(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "default_generation_settings": {"params": {}, "n_ctx": self.n_ctx},
                "total_slots": self.n_slots,
                "model_alias": self.model_name,
                "model_path": self.model_path,
                "chat_template": "fake",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "build_info": "fake",
                "is_sleeping": self.is_sleeping,
                "endpoint_slots": self.slots_endpoint,
            }
        )

    async def _models(self, request: web.Request) -> web.Response:
        info = {
            "id": self.model_name,
            "aliases": [],
            "tags": [],
            "object": "model",
            "created": int(time.time()),
            "owned_by": "llamacpp",
            "meta": {"n_vocab": N_VOCAB, "n_ctx": self.n_ctx, "n_ctx_train": self.n_ctx},
        }
        models = [{"name": self.model_name, "model": self.model_name, "type": "model"}]
        return web.json_response({"models": models, "object": "list", "data": [info]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        tokens: list[Any] = []
        if "content" in body:
            tokens = tokenize_mixed(body["content"], bool(body.get("add_special", False)))
            if body.get("with_pieces", False):
                tokens = [{"id": t, "piece": detokenize([t])} for t in tokens]
        return web.json_response({"tokens": tokens})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        return web.json_response({"content": detokenize(list(body.get("tokens", [])))})

    async def _apply_template(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        await self.template_hold.passed()
        add_gen = bool(body.get("add_generation_prompt", True))
        return web.json_response({"prompt": render_chat(body.get("messages", []), add_gen)})

    async def _get_slots(self, request: web.Request) -> web.Response:
        if not self.slots_endpoint:
            return error_response(
                "This server does not support slots endpoint. Start it with `--slots`",
                "not_supported_error",
            )
        await self.slots_hold.passed()
        if request.query.get("fail_on_no_slot") and all(s.is_processing for s in self.slots):
            return error_response("no slot available", "unavailable_error")
        return web.json_response([slot.to_json() for slot in self.slots])

    # ----------------------------------------------------------------- slot actions

    async def _post_slot(self, request: web.Request) -> web.Response:
        if self.slot_save_path is None:
            return error_response(
                "This server does not support slots action. Start it with `--slot-save-path`",
                "not_supported_error",
            )
        action = request.query.get("action", "")
        try:
            id_slot = int(request.match_info["id_slot"])
        except ValueError:
            return error_response("Invalid slot ID")
        filename: str | None = None
        if action in ("save", "restore"):
            filename = (await self._body(request)).get("filename")
            if not isinstance(filename, str):
                return error_response("[json.exception.out_of_range.403] key 'filename' not found")
            if not validate_filename(filename):
                self.actions.append((action, _wrap(id_slot, self.n_slots), filename, False))
                return error_response("Invalid filename")
        run: Callable[[FakeSlot], tuple[int, Json]]
        if action == "save":
            assert filename is not None
            run = lambda slot: self._save(slot, id_slot, filename)  # noqa: E731
        elif action == "restore":
            assert filename is not None
            run = lambda slot: self._restore(slot, id_slot, filename)  # noqa: E731
        elif action == "erase":
            run = lambda slot: self._erase(slot, id_slot)  # noqa: E731
        else:
            return error_response("Invalid action")
        # the queue matches deferred tasks on the task's id_slot, which slot actions leave at
        # -1: a deferred action is only popped when no deferred task names the freed slot
        target = _wrap(id_slot, self.n_slots)
        future = asyncio.get_running_loop().create_future()
        ticket = _Ticket(id_slot=-1, prompt=[], future=future, action=run, target=target)
        status, payload = await self._submit(ticket)
        if self.action_delay:
            await asyncio.sleep(self.action_delay)  # the file is written; the reply is late
        self.actions.append((action, target, filename, status == 200))
        return web.json_response(payload, status=status)

    def _save(self, slot: FakeSlot, id_slot: int, filename: str) -> tuple[int, Json]:
        assert self.slot_save_path is not None
        t0 = time.perf_counter()
        path = self.slot_save_path / filename
        if self.wipe_before_save:  # an idle-slot wipe that lands just before the save
            slot.tokens.clear()
        n = len(slot.tokens)
        data = encode_state(slot.tokens)
        try:
            if self.fail_saves:  # ENOSPC halfway: llama.cpp leaves the partial file behind
                path.write_bytes(data[: len(data) // 2])
                raise OSError("No space left on device")
            path.write_bytes(data)
            if self.write_sidecar:
                Path(str(path) + SIDECAR_SUFFIX).write_bytes(encode_sidecar(n))
        except OSError:
            return 500, error_json("Unable to save slot", "server_error")
        return 200, {
            "id_slot": id_slot,
            "filename": filename,
            "n_saved": n,
            "n_written": len(data),
            "timings": {"save_ms": (time.perf_counter() - t0) * 1e3},
        }

    def _read_state(self, path: Path, n_ctx: int) -> tuple[list[int], int]:
        """llama_state_seq_load_file + server_tokens::deserialize; raises ValueError."""
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ValueError(BAD_FILE) from err
        tokens, kv_end = decode_state(data, n_ctx)
        if self.write_sidecar and not Path(str(path) + SIDECAR_SUFFIX).is_file():
            raise ValueError("failed to load context checkpoints")
        return tokens, kv_end

    def _restore(self, slot: FakeSlot, id_slot: int, filename: str) -> tuple[int, Json]:
        assert self.slot_save_path is not None
        t0 = time.perf_counter()
        try:
            tokens, n_read = self._read_state(self.slot_save_path / filename, slot.n_ctx)
        except ValueError as err:
            slot.clear()
            return 400, error_json(f"Unable to restore slot: {err}", "invalid_request_error")
        slot.tokens = tokens
        slot.restored = True
        slot.restored_n = len(tokens)
        return 200, {
            "id_slot": id_slot,
            "filename": filename,
            "n_restored": len(tokens),
            "n_read": n_read,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1e3},
        }

    def _erase(self, slot: FakeSlot, id_slot: int) -> tuple[int, Json]:
        n_erased = len(slot.tokens)
        slot.clear()
        return 200, {"id_slot": id_slot, "n_erased": n_erased}

    # ----------------------------------------------------------------- completions

    def _job(self, body: Json, prompt: list[int], reply: str, *limit_keys: str) -> Job:
        if not prompt:
            raise RequestError("empty prompt")
        if any(not 0 <= t < N_VOCAB for t in prompt):
            raise RequestError("Prompt contains invalid tokens")
        n_predict = -1
        for key in limit_keys:
            if body.get(key) is not None:
                n_predict = int(body[key])
                break
        stream = bool(body.get("stream", False))
        return Job(
            prompt=prompt,
            generated=[*tokenize(reply), EOS],
            n_predict=n_predict,
            id_slot=int(body.get("id_slot", -1)),
            cache_prompt=bool(body.get("cache_prompt", True)),
            stream=stream,
            params={"n_predict": n_predict, "stream": stream, "id_slot": body.get("id_slot", -1)},
        )

    async def _launch(self, job: Job) -> Run:
        """Queue the task, get its slot and decide how much of the prompt is reused."""
        future = asyncio.get_running_loop().create_future()
        slot: FakeSlot = await self._submit(_Ticket(job.id_slot, job.prompt, future))
        run = Run(slot=slot, job=job)
        slot.id_task = self._new_id()
        slot.n_predict, slot.params = job.n_predict, job.params
        n_prompt = len(job.prompt)
        if n_prompt >= slot.n_ctx:
            self._finish(run)
            raise RequestError(
                f"request ({n_prompt} tokens) exceeds the available context size "
                f"({slot.n_ctx} tokens), try increasing it",
                "exceed_context_size_error",
                n_prompt_tokens=n_prompt,
                n_ctx=slot.n_ctx,
            )
        n_past = common_prefix(slot.tokens, job.prompt) if job.cache_prompt else 0
        if slot.restored and n_past > 0:
            extends = n_past == len(slot.tokens) and n_prompt > len(slot.tokens)
            if self.reuse == "none" or (self.reuse == "extend" and not extends):
                n_past = 0  # no context checkpoint to go back to after a restore
        if self.reuse == "window" and 0 < n_past < slot.restored_n:
            if slot.restored_n - n_past > self.window:
                n_past = 0
        if self.reuse == "window":
            slot.restored_n = min(slot.restored_n, n_past)
        n_past = min(n_past, n_prompt - 1)  # at least one token is always evaluated
        slot.restored = False
        slot.tokens = slot.tokens[:n_past]
        slot.n_prompt_cached, slot.n_prompt_processed, slot.n_decoded = n_past, 0, 0
        run.cache_n = n_past
        return run

    async def _prefill(self, run: Run) -> None:
        t0 = time.perf_counter()
        rest = run.job.prompt[run.cache_n :]
        for i in range(0, len(rest), N_BATCH):
            chunk = rest[i : i + N_BATCH]
            if self.prompt_delay > 0:
                await asyncio.sleep(self.prompt_delay * len(chunk))
            run.slot.tokens.extend(chunk)
            run.slot.n_prompt_processed += len(chunk)
        run.t_prompt_ms = (time.perf_counter() - t0) * 1e3

    def _planned(self, job: Job) -> Iterator[int]:
        """What the model samples: the reply, then EOS. With ignore_eos EOS is never sampled and
        the model goes on saying its reply again."""
        if not self.ignore_eos:
            return iter(job.generated)
        return itertools.cycle(job.generated[:-1] or tokenize(" "))

    async def _generate(self, run: Run) -> AsyncIterator[int]:
        """Sample the planned tokens; the KV holds each sampled token but the last one."""
        job, slot = run.job, run.slot
        n_max = None if job.n_predict < 0 else max(job.n_predict, 1)
        t0 = time.perf_counter()
        for tok in itertools.islice(self._planned(job), n_max):
            if self.token_delay > 0:
                await asyncio.sleep(self.token_delay)
            if run.sampled:
                slot.tokens.append(run.sampled[-1])
            run.sampled.append(tok)
            slot.n_decoded += 1
            run.t_gen_ms = (time.perf_counter() - t0) * 1e3
            yield tok
            if len(job.prompt) + len(run.sampled) >= slot.n_ctx:
                break  # out of context: stops like a length limit

    def _finish(self, run: Run) -> None:
        if not run.released:
            run.released = True
            self._release(run.slot)

    async def _drive(self, request: web.Request, job: Job, fmt: Format) -> web.StreamResponse:
        run = await self._launch(job)
        try:
            resp: web.StreamResponse | None = None
            if job.stream:  # headers go out as soon as the task is on a slot
                resp = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                )
                await resp.prepare(request)
            await self._prefill(run)
            async for tok in self._generate(run):
                if resp is not None:
                    for event in fmt.stream_events(run, tok):
                        await resp.write(event)
            self._finish(run)  # the slot is idle before the client sees the end
            if resp is None:
                return web.json_response(fmt.final(run))
            for chunk in fmt.final_stream(run):
                await resp.write(sse(chunk))
            if fmt.done_marker:
                await resp.write(b"data: [DONE]\n\n")
            # A client may hang up as soon as it has the last event, before the stream ends.
            await asyncio.sleep(self.end_delay)
            await resp.write_eof()
            # llama-server closes the connection after every streamed reply (its head says
            # Keep-Alive all the same).
            transport = request.transport
            if transport is not None:
                asyncio.get_running_loop().call_later(STREAM_CLOSE_S, transport.close)
            return resp
        finally:
            self._finish(run)

    def _cmpl_id(self) -> str:
        return f"chatcmpl-fake{self._next_id + 1:019d}"

    async def _prompt_job(self, request: web.Request) -> Job:
        body = await self._body(request)
        if "prompt" not in body:
            raise RequestError('"prompt" is required')
        prompt = tokenize_mixed(body["prompt"], add_special=True)
        reply = self.reply(
            [{"role": "user", "content": token_bytes(prompt).decode("utf-8", "replace")}]
        )
        return self._job(body, prompt, reply, "n_predict", "max_tokens")

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        job = await self._prompt_job(request)
        return await self._drive(request, job, CompletionFormat(self.model_name, self._cmpl_id()))

    async def _completion_oai(self, request: web.Request) -> web.StreamResponse:
        job = await self._prompt_job(request)
        fmt = OaiCompletionFormat(self.model_name, f"cmpl-fake{self._next_id + 1:019d}")
        return await self._drive(request, job, fmt)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("'messages' is required and must be a non-empty array")
        text = render_chat(messages, bool(body.get("add_generation_prompt", True)))
        prompt = tokenize(text, add_special=True)
        tools = body.get("tools") or []
        use_tools = bool(tools) and body.get("tool_choice") != "none"
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking") is True
        raw = THINK_OPEN + REASONING_TEXT + THINK_CLOSE if thinking else ""
        last = messages[-1]
        if (
            use_tools
            and last.get("role") == "user"
            and TOOL_TRIGGER in content_text(last.get("content"))
        ):
            name = (tools[0].get("function") or {}).get("name", "tool")
            call = json.dumps({"name": name, "arguments": TOOL_ARGUMENTS})
            raw += f"{TOOL_OPEN}\n{call}\n{TOOL_CLOSE}"
        else:
            raw += self.reply(messages)
        job = self._job(body, prompt, raw, "n_predict", "max_completion_tokens", "max_tokens")
        digest = hashlib.sha256(text.encode()).hexdigest()
        fmt = ChatFormat(
            self.model_name,
            self._cmpl_id(),
            thinking=thinking and body.get("reasoning_format") != "none",
            tools=use_tools,
            call_id=lambda i: f"call_{digest[:20]}{i:04d}",
            include_usage=bool((body.get("stream_options") or {}).get("include_usage")),
        )
        return await self._drive(request, job, fmt)


# --------------------------------------------------------------------------- as a process


async def _serve(fake: FakeLlamaServer, port: int) -> None:
    """Until SIGTERM or SIGINT (how benchmarks stop their helper processes)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await fake.start(port)
    try:
        await stop.wait()
    finally:
        await fake.stop()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m kvproxy_fake.server",
        description="A fake llama-server that answers at once (no prompt or token delays).",
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--parallel", type=int, default=1, help="slots (llama-server -np)")
    parser.add_argument("--ctx-size", type=int, default=4096, help="context tokens per slot")
    parser.add_argument(
        "--slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve GET /slots (--no-slots: 501, as llama-server --no-slots)",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="every reply runs to its max_tokens"
    )
    args = parser.parse_args(argv)
    fake = FakeLlamaServer(
        n_slots=args.parallel,
        n_ctx=args.ctx_size,
        slots_endpoint=args.slots,
        ignore_eos=args.ignore_eos,
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(fake, args.port))


if __name__ == "__main__":
    main()
