"""A stand-in llama-server binary for start-up tests: it dies the way llama-server dies on
Intel VMs whose CPU lists AMX (SIGILL at warm-up, or now and then SIGSEGV, unless started
with --no-repack), or answers like a server without slots (health, and a canned chat reply).

`standin_binary(dir, mode)` writes an executable that runs `main(mode, record)`; each start
appends its argv to `record`, so tests can count the attempts.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import sys
import time
from pathlib import Path

from aiohttp import web

REPO = Path(__file__).resolve().parent.parent
DIES_UNLESS_NO_REPACK = "sigill-unless-no-repack"
ALWAYS_DIES = "sigill-always"
# The other way the AMX kernels kill it: a general protection fault on `ldtilecfg`.
SEGV_UNLESS_NO_REPACK = "sigsegv-unless-no-repack"
SEGV_ALWAYS = "sigsegv-always"
# Dies by SIGSEGV before a line reaches its output (llama-server logs from a thread).
SEGV_SILENTLY = "sigsegv-silently"
SLOW_START = "slow-start"  # healthy only after SLOW_START_S, as while a model loads
SLOW_START_S = 2.5
REPLY = "stand-in says hello"


def standin_binary(directory: Path, mode: str) -> tuple[Path, Path]:
    """(the executable, the file its starts are recorded in)."""
    record = directory / f"standin-{mode}.starts"
    binary = directory / f"llama-server-{mode}"
    script = (
        f"#!{sys.executable}\n"
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\n"
        "from tests.standin_server import main\n"
        f"main({mode!r}, {str(record)!r})\n"
    )
    if not binary.exists():  # rewritten, it would be another binary (a rebuild)
        binary.write_text(script)
        binary.chmod(0o755)
    return binary, record


def starts(record: Path) -> list[list[str]]:
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines()]


def main(mode: str, record: str) -> None:
    argv = sys.argv[1:]
    if argv == ["--help"]:  # as llama-server's: its flags, and no start (kvproxy reads it)
        print("--port PORT\n--slot-save-path PATH", flush=True)
        return
    with open(record, "a") as f:
        f.write(json.dumps(argv) + "\n")
    repack = "--no-repack" not in argv
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if mode == SEGV_SILENTLY:
        os.kill(os.getpid(), signal.SIGSEGV)
    print("system_info: n_threads = 2 | CPU : AMX_INT8 = 1 |", flush=True)
    print("llama threadpool init, n_threads = 2", flush=True)
    if mode == ALWAYS_DIES or (mode == DIES_UNLESS_NO_REPACK and repack):
        os.kill(os.getpid(), signal.SIGILL)
    if mode == SEGV_ALWAYS or (mode == SEGV_UNLESS_NO_REPACK and repack):
        os.kill(os.getpid(), signal.SIGSEGV)
    port = int(argv[argv.index("--port") + 1])
    if mode == SLOW_START:
        print("llama_model_loader: loaded meta data", flush=True)
        time.sleep(SLOW_START_S)

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def chat(_request: web.Request) -> web.Response:
        message = {"role": "assistant", "content": REPLY}
        return web.json_response(
            {
                "id": "chatcmpl-standin",
                "object": "chat.completion",
                "created": 0,
                "model": "standin",
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7},
            }
        )

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_post("/v1/chat/completions", chat)
    web.run_app(app, host="127.0.0.1", port=port, print=None, handle_signals=True)


class RawUpstream:
    """A stand-in llama-server at the socket level, for framing no HTTP library would write:
    each request (head, and a Content-Length body) gets the raw bytes `replies` has for its
    path (else a small 200), on a kept-alive connection, as cpp-httplib keeps them."""

    def __init__(self, replies: dict[str, bytes]) -> None:
        self.replies = replies
        self.requests: list[bytes] = []
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":", 1)[1]))
                self.requests.append(head)
                path = head.split(b" ", 2)[1].decode().split("?", 1)[0]
                reply = self.replies.get(path, b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                writer.write(reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
