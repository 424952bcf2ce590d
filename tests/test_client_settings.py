"""The client settings the docs name, checked against the clients themselves (no llama-server:
a stand-in records what each client sends and answers the shortest valid reply).

- OpenClaw sends `max_completion_tokens` = the model's `maxTokens` (8192 when the config has
  none), which takes precedence over llama-server's `-n`: examples/openclaw.json sets 1024.
- Claude Code sends `max_tokens` 32000 (128000 for its default model) with adaptive thinking,
  and for a model id it does not know (`ANTHROPIC_MODEL=local`) assumes a 1M-token context;
  `CLAUDE_CODE_MAX_OUTPUT_TOKENS`, `CLAUDE_CODE_DISABLE_THINKING=1` and
  `CLAUDE_CODE_MAX_CONTEXT_TOKENS` set each to what a local server has.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from kvproxy.server.managed import free_port

from .agents import CLAUDE_CODE, OPENCLAW, client_env, install

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "openclaw.json"


def _sse(event: str | None, data: dict[str, Any]) -> bytes:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data)}\n\n".encode()


class Recorder:
    """Answers chat completions and Anthropic messages with "ok", keeping each body."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/messages", self._messages)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.bodies.append(await request.json())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk: dict[str, Any] = {
            "id": "c1",
            "object": "chat.completion.chunk",
            "created": 1,
            "model": "local",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}],
        }
        await resp.write(_sse(None, chunk))
        chunk["choices"] = [{"index": 0, "delta": {}, "finish_reason": "stop"}]
        await resp.write(_sse(None, chunk))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        usage = {"input_tokens": 10, "output_tokens": 1}
        message = {"id": "m1", "type": "message", "role": "assistant", "model": body["model"]}
        if not body.get("stream"):
            text = [{"type": "text", "text": "ok"}]
            reply = {**message, "content": text, "stop_reason": "end_turn", "usage": usage}
            return web.json_response({**reply, "stop_sequence": None})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
        events: list[tuple[str, dict[str, Any]]] = [
            ("message_start", {"message": {**start, "usage": {**usage, "output_tokens": 0}}}),
            ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
            ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": "ok"}}),
            ("content_block_stop", {"index": 0}),
            (
                "message_delta",
                {"delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 1}},
            ),
            ("message_stop", {}),
        ]
        for name, data in events:
            await resp.write(_sse(name, {"type": name, **data}))
        return resp


@pytest.fixture
async def recorder() -> AsyncIterator[Recorder]:
    rec = Recorder()
    await rec.start()
    try:
        yield rec
    finally:
        await rec.stop()


async def run_client(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        cwd=cwd,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    assert proc.returncode is not None
    return proc.returncode, out.decode() + err.decode()


async def openclaw_sends(recorder: Recorder, home: Path, config: dict[str, Any]) -> dict[str, Any]:
    exe = await asyncio.to_thread(install, OPENCLAW)
    config["models"]["providers"]["kvproxy"]["baseUrl"] = recorder.url + "/v1"
    path = home / ".openclaw" / "openclaw.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(config))
    argv = [str(exe), "agent", "--local", "--session-id", "s1", "-m", "hi", "--timeout", "120"]
    code, out = await run_client(argv, client_env(home), home)
    assert code == 0, out[-2000:]
    assert recorder.bodies, out[-2000:]
    return recorder.bodies[-1]


async def test_openclaw_caps_replies_at_the_examples_max_tokens(
    recorder: Recorder, tmp_path: Path
) -> None:
    config = json.loads(EXAMPLE.read_text())
    body = await openclaw_sends(recorder, tmp_path, config)
    cap = config["models"]["providers"]["kvproxy"]["models"][0]["maxTokens"]
    assert body["max_completion_tokens"] == cap == 1024


async def test_openclaw_without_max_tokens_asks_for_8192(
    recorder: Recorder, tmp_path: Path
) -> None:
    config = json.loads(EXAMPLE.read_text())
    del config["models"]["providers"]["kvproxy"]["models"][0]["maxTokens"]
    body = await openclaw_sends(recorder, tmp_path, config)
    assert body["max_completion_tokens"] == 8192


async def claude_sends(recorder: Recorder, home: Path, **env: str) -> tuple[dict[str, Any], str]:
    exe = await asyncio.to_thread(install, CLAUDE_CODE)
    full = client_env(home) | {
        "ANTHROPIC_BASE_URL": recorder.url,
        "ANTHROPIC_API_KEY": "x",
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        **env,
    }
    code, out = await run_client([str(exe), "-p", "hi"], full, home)
    assert code == 0, out[-2000:]
    assert recorder.bodies, out[-2000:]
    return recorder.bodies[-1], out


UNKNOWN_WINDOW = "assumes a context window of 1m tokens"


async def test_claude_code_defaults_for_a_local_model(recorder: Recorder, tmp_path: Path) -> None:
    body, out = await claude_sends(recorder, tmp_path, ANTHROPIC_MODEL="local")
    assert body["model"] == "local"
    assert body["max_tokens"] == 32000 and body["thinking"]["type"] == "adaptive"
    assert UNKNOWN_WINDOW in out


async def test_claude_code_settings_the_docs_give(recorder: Recorder, tmp_path: Path) -> None:
    body, out = await claude_sends(
        recorder,
        tmp_path,
        ANTHROPIC_MODEL="local",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS="1024",
        CLAUDE_CODE_DISABLE_THINKING="1",
        CLAUDE_CODE_MAX_CONTEXT_TOKENS="32768",
    )
    assert body["model"] == "local" and body["max_tokens"] == 1024
    assert "thinking" not in body
    assert UNKNOWN_WINDOW not in out
