"""A server's fingerprint: everything that changes the KV it computes for a token sequence.

A restored state is only right on a server that would compute it: the same weights, adapters
and scales, rope and YaRN settings, metadata overrides, KV layout, chat template and build.
The fingerprint gathers what can be known of them when a server is seen to start:

- GET /props: the model's path and weight type, the context per slot, the build, the chat
  templates (a template change makes old states misses instead of restores nobody reuses);
- the weights' content (weights.content_digest) at that path, resolved against the server's
  working directory when it is relative;
- GET /lora-adapters: each adapter's content and the scale a request naming none gets;
- the server's KV flags (kvflags.py), from its command line when this machine shows its
  process (localproc.py), managed mode's own, or a router's `status.args` for its model;
- what it renders for a fixed conversation (POST /apply-template: `--jinja`, kwargs);
- the behavioural probe (probe.py): what it computes for a fixed prompt.

It is read when a server is seen for the first time, changed, or back after being
unreachable or restarted, never under a running server: a model file replaced on disk while
the server runs changes nothing the server computes until it starts again. Such a change is
noticed (`changed_files`), and the backend stops saving and restoring until the server is
seen to start again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import xxhash

from kvproxy.config import Settings
from kvproxy.http.session import UpstreamError
from kvproxy.server import kvflags, localproc, probe
from kvproxy.server.api import LlamaClient
from kvproxy.server.localproc import ServerProcess
from kvproxy.server.modellist import list_models
from kvproxy.server.weights import FileStamp, stamp

log = logging.getLogger("kvproxy.server")

# A conversation every chat template renders: what it renders tells the template apart.
TEMPLATE_PROBE: list[dict[str, str]] = [
    {"role": "system", "content": "You are a probe."},
    {"role": "user", "content": "Hello?"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye?"},
]

Prober = Callable[[], Awaitable["probe.Behaviour | None"]]
Watched = tuple[Path, "FileStamp | None", str]  # a file read: its stamp and content digest
NOT_PROBED = "not probed"


@dataclass(frozen=True)
class Fingerprint:
    text: str  # the identity every key of this server's conversations starts from
    lora_defaults: tuple[float, ...] = ()  # GET /lora-adapters' scales, in adapter order
    props: tuple[str, ...] = ()  # what GET /props shows of it (props_part)
    process: ServerProcess | None = None  # its process, when this machine shows it
    # Files whose content it holds (model, adapters, flags' files) as they were read.
    files: tuple[Watched, ...] = ()
    flags: tuple[tuple[str, str], ...] = ()  # its KV flags, where known
    flags_known: bool = False  # its command line was read (absent flags are absent)
    # The behavioural probe ran (False: it failed this time, a router swapping models, no
    # idle slot; the fingerprint is then read again soon, and nothing saved meanwhile).
    probed: bool = True
    config: str = ""  # a digest of all but the probe

    def has_flag(self, name: str) -> bool:
        return any(flag == name for flag, _ in self.flags)

    @property
    def swa_full(self) -> bool | None:
        """Whether the server runs with --swa-full (None: its flags are not known)."""
        return self.has_flag("--swa-full") if self.flags_known else None


def props_part(props: Mapping[str, Any]) -> tuple[str, ...]:
    """What GET /props shows that changes a state: the model's path and weight type, the
    context per slot, the build, the chat templates (as digests)."""
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx", "") if isinstance(settings, Mapping) else ""
    return (
        str(props.get("model_path", "")),
        str(n_ctx),
        str(props.get("model_ftype") or ""),
        str(props.get("build_info") or ""),
        _digest(props.get("chat_template")),
        _digest(props.get("chat_template_tool_use")),
    )


class Fingerprinter:
    """Reads one server's fingerprint. `router_model`: a router's model, whose command line
    GET /models shows. `managed_args`: managed mode's flags for the
    server, used where its process cannot be read."""

    def __init__(
        self,
        client: LlamaClient,
        url: str,
        cache_dir: Path,
        router_model: str | None = None,
        managed_args: Sequence[str] | None = None,
    ) -> None:
        self.client = client
        self.url = url
        self.cache_dir = cache_dir
        self.router_model = router_model
        self.managed_args = list(managed_args) if managed_args is not None else None
        self._warned: set[str] = set()
        self._confirmed: dict[Path, FileStamp] = {}  # stamps of files touched, content kept

    async def same_server(self, known: Fingerprint, props: Mapping[str, Any]) -> bool:
        """Is the server the one `known` was read from (cheap: no file read, no probe)? Its
        /props unchanged, and its process (when known) not restarted."""
        if props_part(props) != known.props:
            return False
        if known.process is None:
            return True
        return await asyncio.to_thread(localproc.same_process, known.process)

    async def changed_files(self, known: Fingerprint) -> list[Path]:
        """Files the server loaded whose content changed on disk since (it still runs what it
        read). A file only touched (its stamp changed, its digest not) is taken as it is."""

        def check() -> list[Path]:
            changed = []
            for path, was, digest in known.files:
                now = stamp(path)
                if now == was or now == self._confirmed.get(path):
                    continue
                if kvflags.file_digest(str(path), None) != digest:
                    changed.append(path)
                elif now is not None:
                    self._confirmed[path] = now
            return changed

        return await asyncio.to_thread(check)

    async def read(self, props: Mapping[str, Any], prober: Prober | None) -> Fingerprint:
        """The server's fingerprint, read now (see the module's docstring)."""
        process = await self._process()
        cwd = process.cwd if process is not None else None
        argv, env = await self._flags_source(process)
        parts: dict[str, Any] = {"props": props_part(props)}
        model_path = str(props.get("model_path") or "")
        files: list[Watched] = []
        parts["weights"] = await self._file(model_path, cwd, files, "model")
        adapters = await self._adapters(cwd, files)
        parts["adapters"] = adapters  # each one's content and default scale
        flags: list[tuple[str, str]] = []
        if argv is not None:
            for flag, value in [*kvflags.from_env(env), *kvflags.parse(argv)]:
                if flag == "--model":
                    continue
                for path in _flag_files(flag, value, cwd):
                    digest = await asyncio.to_thread(kvflags.file_digest, str(path), None)
                    files.append((path, await asyncio.to_thread(stamp, path), digest))
            flags = await asyncio.to_thread(kvflags.settings, argv, env, cwd)
            flags = [(f, v) for f, v in flags if f != "--model"]
        parts["flags"] = flags if argv is not None else None
        parts["template"] = await self._rendered()
        parts["exe"] = await self._exe(process)
        config = xxhash.xxh3_128_hexdigest(orjson.dumps(parts, default=str))
        parts["probe"] = await self._probe(config, prober)
        digest = xxhash.xxh3_128_hexdigest(orjson.dumps(parts, default=str))
        shown = _shown_path(model_path, cwd)
        n_ctx, ftype = parts["props"][1], parts["props"][2]
        text = f"{shown}|{n_ctx}|ftype={ftype}|fp={digest}"
        return Fingerprint(
            text,
            tuple(scale for _, scale in adapters),
            parts["props"],
            process,
            tuple(files),
            tuple(flags),
            argv is not None,
            parts["probe"] != NOT_PROBED,
            config,
        )

    async def _process(self) -> ServerProcess | None:
        """The process listening at the URL (a router's model: the router, whose working
        directory its models' relative paths are read against)."""
        return await asyncio.to_thread(localproc.find, self.url)

    async def _flags_source(
        self, process: ServerProcess | None
    ) -> tuple[Sequence[str] | None, dict[str, str]]:
        if self.router_model is not None:
            try:
                models = await list_models(self.client.upstream)
            except UpstreamError:
                return None, {}
            args = next((m.args for m in models if m.id == self.router_model), None)
            return (list(args) if args is not None else None), {}
        if process is not None:
            return process.argv, process.env
        return self.managed_args, {}

    async def _file(self, value: str, cwd: Path | None, files: list[Watched], what: str) -> str:
        """The content digest of a file the server loaded (never silently nothing)."""
        if not value:
            return ""
        path = kvflags.path_of(value, cwd)
        if not path.is_absolute():
            self._warn_once(
                value,
                f"the {what} {value} is a relative path and the server's working directory is "
                "unknown: its content is not part of the server's fingerprint (the "
                "behavioural probe stands for it); start llama-server with an absolute path",
            )
            return f"unresolved {value}"
        was = await asyncio.to_thread(stamp, path)
        digest = await asyncio.to_thread(kvflags.file_digest, str(path), None)
        files.append((path, was, digest))
        if digest.startswith("unreadable"):
            self._warn_once(
                str(path),
                f"cannot read the {what} {path} ({digest}): its content is not part of the "
                "server's fingerprint (the behavioural probe stands for it)",
            )
        return digest

    async def _adapters(self, cwd: Path | None, files: list[Watched]) -> list[tuple[str, float]]:
        """(content digest, default scale) of each LoRA adapter the server loaded."""
        try:
            raw = await self.client.lora_adapters()
        except UpstreamError:
            return []
        out = []
        for item in raw:
            digest = await self._file(str(item.get("path") or ""), cwd, files, "LoRA adapter")
            scale = item.get("scale")
            out.append((digest, float(scale) if isinstance(scale, int | float) else 0.0))
        return out

    async def _rendered(self) -> str:
        """What the server renders for a fixed conversation (its template, as applied)."""
        try:
            prompt = await self.client.apply_template(
                {"messages": TEMPLATE_PROBE, "add_generation_prompt": True}
            )
        except UpstreamError as exc:
            return f"not rendered: {exc.status}"
        return _digest(prompt)

    async def _exe(self, process: ServerProcess | None) -> str:
        if process is None or process.exe is None:
            return ""
        exe = str(process.exe)
        return await asyncio.to_thread(kvflags.file_digest, exe, None)

    async def _probe(self, config: str, prober: Prober | None) -> str:
        if prober is None:
            return "no probe"
        try:
            seen = await prober()
        except UpstreamError as exc:
            if exc.status in (404, 501):
                return "no probe route"  # the server has none: the probe never runs there
            log.warning("the behavioural probe of %s failed: %s", self.url, exc)
            return NOT_PROBED
        if seen is None:
            return "no probabilities"  # the server does not report them
        try:
            return await asyncio.to_thread(probe.class_of, self.cache_dir, config, seen)
        except OSError as exc:
            log.warning("cannot keep the probe's result in %s: %s", self.cache_dir, exc)
            return probe.behaviour_id(seen)

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("%s", message)


def _flag_files(flag: str, value: str, cwd: Path | None) -> list[Path]:
    kind = kvflags.FLAGS[flag][2]
    if kind == "file":
        names = [value]
    elif kind == "files":
        names = value.split(",")
    elif kind == "scaled":
        names = [item.rpartition(":")[0] for item in value.split(",")]
    else:
        return []
    return [kvflags.path_of(n, cwd) for n in names if n]


def _shown_path(path: str, cwd: Path | None) -> str:
    return str(kvflags.path_of(path, cwd)) if path else ""


def _digest(value: Any) -> str:
    if not isinstance(value, str) or not value:
        return ""
    return xxhash.xxh3_64_hexdigest(value.encode("utf-8", "surrogateescape"))


def managed_args(settings: Settings) -> list[str] | None:
    """The flags managed mode starts its one server with (None: not managed mode)."""
    return list(settings.server_args) if settings.model else None
