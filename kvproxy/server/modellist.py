"""A router-mode llama-server's own view of its models: GET /models and /models/sse, read
into records (the facts are in docs/how-it-works.md, "Router mode").

A router (llama-server started without a model, with `--models-dir` or `--models-preset`)
answers GET /props itself with `"role": "router"` and runs each model as a child server of
its own, started with the router's flags. GET /models lists every model it knows with its
status and the child's command line (`status.args`, there even before the first load), and,
while the child runs, what the child reports (`meta`: `n_ctx` per slot, sizes). Neither GET
loads a model nor wakes one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson

from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.server.modelinfo import model_identity

ModelStatus = Literal["loaded", "loading", "unloaded", "sleeping", "downloading", "unknown"]
STATUSES: frozenset[str] = frozenset({"loaded", "loading", "unloaded", "sleeping", "downloading"})
# A child process runs (server_model_meta::is_running): its slots hold what they held, even
# asleep (then the KV is gone but the process stays; a request wakes it).
RUNNING: frozenset[str] = frozenset({"loaded", "loading", "sleeping"})

# How the router writes a child's flags (common_preset::to_args: the long form of each).
MODEL_FLAGS = ("--model", "-m")
SAVE_PATH_FLAGS = ("--slot-save-path",)


def is_router(props: Mapping[str, Any]) -> bool:
    """Whether GET /props (without `?model=`) came from a router."""
    return props.get("role") == "router"


def flag_value(args: Sequence[str], names: Sequence[str]) -> str | None:
    """The value of the last of `names` in a command line (`--flag V` or `--flag=V`)."""
    found: str | None = None
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                found = args[i + 1]
            elif arg.startswith(name + "="):
                found = arg[len(name) + 1 :]
    return found


@dataclass(frozen=True)
class RouterModel:
    """One model as GET /models lists it."""

    id: str
    status: ModelStatus
    args: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()
    failed: bool = False  # the child exited with an error (`exit_code`)
    exit_code: int | None = None
    n_ctx: int | None = None  # tokens per slot; reported only while the child runs
    size: int | None = None  # the model's bytes, as the child reports them
    ftype: str | None = None  # the weights' type, as the child reports it (`meta.ftype`)

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    @property
    def path(self) -> str:
        """The GGUF file the child loads (its `--model`), "" for a model the router only
        knows by name (a download)."""
        return flag_value(self.args, MODEL_FLAGS) or ""

    @property
    def slot_save_path(self) -> str | None:
        """The child's --slot-save-path: the router passes its own flags on to each child."""
        return flag_value(self.args, SAVE_PATH_FLAGS)

    def names(self) -> frozenset[str]:
        """What a request's "model" may say to reach this model."""
        return frozenset((self.id, *self.aliases))

    def identity(self) -> str:
        """Which model and KV layout produced a state, in the form a single server's
        identity takes (the GGUF path, tokens per slot, the file's size and mtime, the
        weights' type); what the child reports is known while it runs."""
        n_ctx = "" if self.n_ctx is None else self.n_ctx
        props = {"model_path": self.path, "default_generation_settings": {"n_ctx": n_ctx}}
        return model_identity({**props, "model_ftype": self.ftype})

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RouterModel:
        status = raw.get("status") if isinstance(raw.get("status"), Mapping) else {}
        assert isinstance(status, Mapping)
        value = status.get("value")
        meta = raw.get("meta") if isinstance(raw.get("meta"), Mapping) else {}
        assert isinstance(meta, Mapping)
        args = status.get("args")
        aliases = raw.get("aliases")
        return cls(
            id=str(raw.get("id", "")),
            status=value if isinstance(value, str) and value in STATUSES else "unknown",  # type: ignore[arg-type]
            args=tuple(str(a) for a in args) if isinstance(args, list) else (),
            aliases=tuple(str(a) for a in aliases) if isinstance(aliases, list) else (),
            failed=status.get("failed") is True,
            exit_code=_int(status.get("exit_code")),
            n_ctx=_int(meta.get("n_ctx")),
            size=_int(meta.get("size")),
            ftype=meta.get("ftype") if isinstance(meta.get("ftype"), str) else None,
        )


def read_models(raw: Any) -> list[RouterModel]:
    """GET /models of a router: `{"data": [...], "object": "list"}`."""
    data = raw.get("data") if isinstance(raw, Mapping) else None
    if not isinstance(data, list):
        raise UpstreamError(f"GET /models answered no model list: {str(raw)[:200]}")
    return [RouterModel.from_json(m) for m in data if isinstance(m, Mapping)]


async def list_models(upstream: Upstream) -> list[RouterModel]:
    return read_models(await upstream.get_json("/models"))


@dataclass(frozen=True)
class ModelEvent:
    """One /models/sse event: `model_status` (a child spawned: `loading`) and
    `status_change` (each later step) carry the model's new `status`; `model_remove`,
    `download_progress` and `models_reload` (model "*": the whole list changed) none."""

    model: str
    event: str
    status: ModelStatus | None = None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ModelEvent:
        data = raw.get("data") if isinstance(raw.get("data"), Mapping) else {}
        assert isinstance(data, Mapping)
        value = data.get("status")
        status: ModelStatus | None = None
        if isinstance(value, str):
            status = value if value in STATUSES else "unknown"  # type: ignore[assignment]
        return cls(str(raw.get("model", "")), str(raw.get("event", "")), status)


def parse_event(line: bytes) -> ModelEvent | None:
    """One line of the stream: `data: {...}` gives an event, anything else None."""
    if not line.startswith(b"data:"):
        return None
    try:
        raw = orjson.loads(line[5:].strip())
    except orjson.JSONDecodeError:
        return None
    return ModelEvent.from_json(raw) if isinstance(raw, Mapping) else None


async def model_events(upstream: Upstream) -> AsyncIterator[ModelEvent]:
    """The router's /models/sse events as they come, until the router closes the stream
    (raises UpstreamError when it cannot be opened)."""
    try:
        async with upstream.session.get(
            upstream.url("/models/sse"),
            headers=upstream.auth_headers(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, connect=30),
        ) as resp:
            if resp.status != 200:
                raise UpstreamError(f"GET /models/sse -> {resp.status}", resp.status)
            async for line in resp.content:
                event = parse_event(line)
                if event is not None:
                    yield event
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamError(f"GET /models/sse failed: {exc}") from exc


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
