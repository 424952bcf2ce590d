"""A fast fake llama-server for `overhead`: it answers at once, so what is measured through
kvproxy is kvproxy's own cost. Run as `python -m kvproxy.bench.fakeupstream --port P`.

- `POST /v1/chat/completions`: non-streamed, a small chat reply with `timings`; streamed,
  `max_tokens` SSE events, one write each (as llama-server sends one event per token), then
  a final chunk with `timings` and `data: [DONE]`.
- `GET /props`, `GET /slots` answer with llama-server's shapes, so kvproxy turns its cache
  on (`--slots`); with `--no-slots`, `/slots` answers 501 and kvproxy passes requests
  through uncached. Slot save/restore answer 501: the overhead runs never touch the disk.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import orjson
from aiohttp import web

N_CTX = 4096


def build_fake(slots: bool) -> web.Application:
    state = {"task": 0}

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def props(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "default_generation_settings": {"params": {}, "n_ctx": N_CTX},
                "total_slots": 1,
                "model_path": "/nonexistent/bench-fake.gguf",
                "build_info": "bench-fake",
            }
        )

    async def get_slots(_request: web.Request) -> web.Response:
        if not slots:
            return _error(501, "This server does not support slots endpoint.")
        info: dict[str, Any] = {"id": 0, "n_ctx": N_CTX, "is_processing": False}
        if state["task"]:
            info.update(id_task=state["task"], n_prompt_tokens=24)
        return web.json_response([info])

    async def post_slot(_request: web.Request) -> web.Response:
        return _error(501, "This server does not support slot actions.")

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        state["task"] += 1
        n = int(body.get("max_tokens") or 8)
        timings = {"cache_n": 0, "prompt_n": 24, "prompt_ms": 1.0, "predicted_n": n}
        if not body.get("stream"):
            reply = {
                "id": "chatcmpl-bench",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": "bench-fake",
                "choices": [
                    {
                        "index": 0,
                        "finish_reason": "length",
                        "message": {"role": "assistant", "content": "ok " * n},
                    }
                ],
                "usage": {"prompt_tokens": 24, "completion_tokens": n, "total_tokens": 24 + n},
                "timings": timings,
            }
            return web.Response(body=orjson.dumps(reply), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = (
            b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk","model":"bench-fake",'
            b'"choices":[{"index":0,"delta":{"content":"ok "},"finish_reason":null}]}\n\n'
        )
        for _ in range(n):
            await resp.write(event)
        last = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
            "timings": timings,
        }
        await resp.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/props", props)
    app.router.add_get("/slots", get_slots)
    app.router.add_post("/slots/{id}", post_slot)
    app.router.add_post("/v1/chat/completions", chat)
    return app


def _error(status: int, message: str) -> web.Response:
    return web.json_response(
        {"error": {"code": status, "message": message, "type": "not_supported_error"}},
        status=status,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    web.run_app(
        build_fake(args.slots), host="127.0.0.1", port=args.port, access_log=None, print=None
    )


if __name__ == "__main__":
    main()
