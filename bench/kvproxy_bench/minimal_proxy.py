"""The floor of any aiohttp proxy: a minimal pass-through (`python -m
kvproxy_bench.minimal_proxy --port P --upstream URL`), the `overhead` benchmark's yardstick.

One aiohttp server, one ClientSession, each request forwarded as it came and its reply relayed
back (read whole when its length is known, streamed otherwise). No headers kept but the
content type, no checks, no logging: what is left is aiohttp's own cost of a hop.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

UPSTREAM = web.AppKey("upstream", str)
SESSION = web.AppKey("session", aiohttp.ClientSession)


async def forward(request: web.Request) -> web.StreamResponse:
    body = await request.read()
    headers = {"Content-Type": request.headers.get("Content-Type", "application/json")}
    url = request.app[UPSTREAM] + request.path_qs
    async with request.app[SESSION].request(request.method, url, data=body, headers=headers) as up:
        if up.content_length is not None:
            return web.Response(
                body=await up.read(), status=up.status, content_type=up.content_type
            )
        resp = web.StreamResponse(status=up.status, headers={"Content-Type": up.content_type})
        await resp.prepare(request)
        async for chunk in up.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
        return resp


def app(upstream: str) -> web.Application:
    application = web.Application()
    application[UPSTREAM] = upstream.rstrip("/")

    async def session(application: web.Application):  # type: ignore[no-untyped-def]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as s:
            application[SESSION] = s
            yield

    application.cleanup_ctx.append(session)
    application.router.add_route("*", "/{tail:.*}", forward)
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    web.run_app(app(args.upstream), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
