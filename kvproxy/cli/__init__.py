"""`kvproxy` command line: `serve` (sidecar or managed) here; other subcommands live in the
modules named in SUBCOMMANDS, each with `register(subparsers)` that sets `func` on its parser
(`func(args) -> int`)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import gc
import importlib
import importlib.metadata
import logging
import logging.handlers
import os
import queue
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from kvproxy.cli.flags import add_config_flag, add_settings_flags, load_settings
from kvproxy.cli.logwriter import LogWriter
from kvproxy.config import Settings

log = logging.getLogger("kvproxy")
LLAMA_LOGGER = "llama-server"  # llama-server's own lines, relayed (managed.py)

# Modules that add subcommands. They keep heavy imports (matplotlib, aiohttp…) inside their
# commands; bench's and doctor's flags live outside kvproxy_bench and kvproxy.server.doctor, so no
# other command loads them. `serve` imports the proxy (aiohttp, whose import alone loads the
# system's CA certificates twice) when it runs: `kvproxy ls` needs none of it.
SUBCOMMANDS = ("kvproxy.cli.doctor", "kvproxy.cli.inventory", "kvproxy.cli.bench")

# At SIGTERM, saving ends this long before --shutdown-timeout (at most a quarter of it): time
# to stop the managed server and write the last log lines.
STOP_RESERVE_S = 3.0

LOG_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"
LLAMA_LOG_FORMAT = "%(asctime)s   llama-server| %(message)s"


def version() -> str:
    """The installed distribution's version (its metadata: what pip and the index show)."""
    try:
        return importlib.metadata.version("kvproxy")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


class Parser(argparse.ArgumentParser):
    """No abbreviations (`--slot` is not `--slots`): a flag misspelt stops with an error
    rather than setting another one. Subcommands' parsers are of this class too."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvproxy",
        description="Caching reverse proxy for llama.cpp's llama-server.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="run the proxy",
        description=(
            "Run the proxy in front of a llama-server (--upstream URL), or start one "
            "(--model PATH or --model default; --models-dir DIR: a router over the models in "
            "DIR). Flags after `--` go to llama-server."
        ),
    )
    add_config_flag(serve)
    add_settings_flags(serve)
    serve.set_defaults(func=None)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def setup_logging(level: str, json_lines: bool = False) -> LogWriter:
    """Plain text on stderr, or with `json_lines` one JSON object per record (all of them,
    llama-server's relayed lines included), for log shippers. Records are written by a
    thread of their own, in order (a line per request: its write to a slow pipe or terminal
    must not hold up the event loop; `kvproxy.cli.logwriter`); `stop()` on what this returns
    flushes them (done at exit too)."""
    from kvproxy.obs.requestlog import JsonFormatter

    text = logging.Formatter(LOG_FORMAT, "%H:%M:%S")
    relayed = logging.Formatter(LLAMA_LOG_FORMAT, "%H:%M:%S")
    ours = logging.StreamHandler(sys.stderr)
    ours.setFormatter(JsonFormatter() if json_lines else text)
    ours.addFilter(lambda record: record.name != LLAMA_LOGGER)
    theirs = logging.StreamHandler(sys.stderr)
    theirs.setFormatter(JsonFormatter() if json_lines else relayed)
    theirs.addFilter(lambda record: record.name == LLAMA_LOGGER)
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = LogWriter(records, ours, theirs)
    listener.start()
    atexit.register(_stop_quietly, listener)
    to_queue = logging.handlers.QueueHandler(records)
    root = logging.getLogger()
    root.handlers = [to_queue]
    root.setLevel(level.upper())
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    llama = logging.getLogger(LLAMA_LOGGER)
    llama.propagate = False
    llama.handlers = [to_queue]
    return listener


def _stop_quietly(listener: LogWriter) -> None:
    listener.stop()


async def serve(settings: Settings) -> int:
    from kvproxy.edge.listen import close, reserve

    if not settings.loopback and settings.upstream_api_key and not settings.client_api_keys:
        raise SystemExit(
            f"kvproxy: refusing to listen on {settings.host} with --upstream-api-key and no "
            "--client-api-keys: anyone who can reach the port would use llama-server with "
            "its key. Set --client-api-keys KEY[,KEY…] (env KVPROXY_CLIENT_API_KEYS)."
        )
    # The port first, before anything is started: a port another process holds (a second
    # `kvproxy serve`) ends this one here, having touched nothing.
    try:
        bound = reserve(settings)
    except OSError as exc:
        raise SystemExit(
            f"kvproxy: cannot listen on {settings.host}:{settings.port}: "
            f"{exc.strerror or exc} (is another kvproxy running? --port picks another)"
        ) from None
    try:
        return await _serve(settings, bound)
    finally:
        close(bound)


async def _serve(settings: Settings, bound: list[tuple[str, socket.socket]]) -> int:
    from aiohttp import web

    from kvproxy.cli.display import Ticker
    from kvproxy.edge.app import SERVICE, build_app
    from kvproxy.edge.listen import listen, runner_options
    from kvproxy.server import leftover
    from kvproxy.server.fleet import Fleet
    from kvproxy.server.launch import managed_command
    from kvproxy.server.managed import ManagedServer, find_server, free_port
    from kvproxy.server.savepath import unwritable

    fleet: Fleet | None = None
    down: list[str] = []  # sidecar servers that did not answer at start
    if settings.model or settings.models_dir:
        # llama-server saves slots there and kvproxy records what it starts: a dir it cannot
        # write is one line now, not a traceback after the model has loaded.
        problem = await asyncio.to_thread(unwritable, settings.cache_dir)
        if problem is not None:
            raise SystemExit(f"kvproxy: {problem}")
        binary = await asyncio.to_thread(find_server, settings.server_bin)
        ports: list[int] = []
        while len(ports) < settings.servers:
            port = free_port(avoid=settings.port)
            if port not in ports:
                ports.append(port)
        servers = []
        for port in ports:
            launch = await managed_command(settings, binary, port)
            tag = f"{port}" if settings.servers > 1 else ""
            servers.append(ManagedServer(launch.command, port, settings.api_key, tag=tag))
        if launch.sleep_after is not None and settings.server_sleep_after is None:
            settings.server_sleep_after = launch.sleep_after  # saved before it unloads slots
        await asyncio.to_thread(leftover.stop_leftover, settings.cache_dir)
        fleet = Fleet(servers, settings.cache_dir)
        quiet = settings.log_json or logging.getLogger().isEnabledFor(logging.DEBUG)
        # Not at debug level: the servers' lines, held back meanwhile, are shown there.
        loading = "llama-server is loading the model"
        await fleet.start(
            settings.server_start_timeout,
            None
            if quiet
            else lambda i: Ticker.for_terminal(
                loading if settings.servers == 1 else f"{loading} ({i + 1} of {settings.servers})"
            ),
        )
        upstream_urls = fleet.urls
    elif settings.upstream_urls:
        from kvproxy.server.savepath import refuse_foreign_save_paths

        upstream_urls = settings.upstream_urls
        # Its first save would find the mismatch, leaving a temp file in the server's dir.
        down = await refuse_foreign_save_paths(upstream_urls, settings.api_key, settings.cache_dir)
    else:
        raise SystemExit(
            "kvproxy: nothing to proxy: give --upstream URL (a running llama-server) "
            "or --model PATH|default (kvproxy starts llama-server), or --models-dir DIR "
            "(kvproxy starts llama-server as a router over the models in DIR)"
        )

    # From here on a SIGTERM stops kvproxy in order (its managed server too), even one sent as
    # soon as the ready line shows; before, the default action is the way to stop a start.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    app = build_app(settings, upstream_urls)
    if fleet is not None:
        app[SERVICE].server_log = fleet.recent_log  # the status page shows it
    # At SIGTERM requests in flight get a third of the shutdown deadline, then are cut off:
    # aiohttp waits its shutdown_timeout for them to end, then as long again once cancelled.
    runner = web.AppRunner(
        app, **runner_options(settings), shutdown_timeout=settings.shutdown_timeout / 6
    )
    try:
        await runner.setup()
        await listen(runner, settings, bound)
    except OSError as exc:
        await runner.cleanup()
        if fleet is not None:
            await fleet.stop()
        where = f"{settings.host}:{settings.port}"
        raise SystemExit(f"kvproxy: cannot listen on {where}: {exc}") from None

    # Everything loaded so far (modules, settings, the app) lives as long as the process: out of
    # the collector's reach, a full collection no longer walks it (~51k objects: 139 ms
    # measured on this 2-core machine under load), which would otherwise land inside some
    # request now and then.
    gc.collect()
    gc.freeze()
    first = settings.hosts[0]
    shown_host = "localhost" if first in ("127.0.0.1", "::1") else first
    log.info(
        "kvproxy ready: point OpenAI clients at http://%s:%d/v1 (llama-server at %s, cache %s)",
        shown_host,
        settings.port,
        ", ".join(f"{u} (not answering yet)" if u in down else u for u in upstream_urls),
        settings.cache_dir,
    )

    waiters: list[asyncio.Task[Any]] = [asyncio.create_task(stop.wait())]
    supervisor: asyncio.Task[Any] | None = None
    if fleet is not None:
        # A server that dies is started again (fleet.py); one that cannot be ends kvproxy.
        fleet.on_death = app[SERVICE].in_flight.server_died
        app[SERVICE].servers_down_for = fleet.down_for
        supervisor = asyncio.create_task(fleet.supervise())
        waiters.append(supervisor)
    done, pending = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    exit_code = 0
    if supervisor is not None and supervisor in done:
        log.error("%s", supervisor.result())
        exit_code = 1
    else:
        log.info("shutting down: saving slots, then stopping")
    stop_by = time.monotonic() + settings.shutdown_timeout
    # Saving ends early enough to stop the managed server and say what was not saved.
    app[SERVICE].stop_by = stop_by - min(STOP_RESERVE_S, settings.shutdown_timeout / 4)
    try:
        await asyncio.wait_for(runner.cleanup(), settings.shutdown_timeout)
    except TimeoutError:
        # What holds it up runs in a thread (a first import of a large cache dir): the
        # process stops anyway, as promised; the cache dir is consistent at every step.
        log.error(
            "shutdown deadline (%.0f s) passed: stopping now; what was not saved is lost",
            settings.shutdown_timeout,
        )
        exit_code = exit_code or 1
        if fleet is not None:
            await fleet.stop(grace=5.0)
        atexit._run_exitfuncs()  # the log writer's last lines
        os._exit(exit_code)
    if fleet is not None:
        await fleet.stop(grace=max(1.0, stop_by - time.monotonic()))
    # The last line: the stop is over (a terminal showed "shutting down" until now).
    log.info(
        "kvproxy stopped%s%s",
        " with llama-server" if fleet is not None else "",
        f" (exit {exit_code})" if exit_code else "",
    )
    return exit_code


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    server_args: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, server_args = args[:cut], args[cut + 1 :]
    parsed = build_parser().parse_args(args)
    if parsed.func is not None:
        if server_args:
            parsed.server_args = server_args
        # The command line as typed, for commands that print it (benchmarks).
        parsed.argv = [*args, *(["--", *server_args] if server_args else [])]
        return int(parsed.func(parsed))
    cli = {k: v for k, v in vars(parsed).items() if k not in ("command", "func", "config")}
    if server_args:
        cli["server_args"] = server_args
    if parsed.command == "serve":
        from kvproxy.server.managed import ServerError

        settings = load_settings(cli, parsed.config)
        setup_logging(settings.log_level, settings.log_json)
        try:
            return asyncio.run(serve(settings))
        except ServerError as exc:
            print(f"kvproxy: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
    return 2


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
