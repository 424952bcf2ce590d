"""A llama-server on this machine at its default port, for `kvproxy doctor` with no --upstream.

llama-server listens on 8080 unless told otherwise; llama.cpp #26508 announced that a future
release moves the default to 9931 (the bundled build prints that notice and still uses 8080),
so both are tried, 8080 first."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp

DEFAULT_PORTS = (8080, 9931)
PROBE_TIMEOUT_S = 2.0
# /health answers 200 once the model is loaded and 503 while it loads, with no key needed.
SERVER_STATUSES = frozenset({200, 503})
NOT_FOUND = (
    "no --upstream given, and no llama-server answers at "
    + " or ".join(f"127.0.0.1:{port}" for port in DEFAULT_PORTS),
    "start llama-server, or pass --upstream URL (env KVPROXY_UPSTREAM)",
)


def default_urls() -> list[str]:
    return [f"http://127.0.0.1:{port}" for port in DEFAULT_PORTS]


async def _answers(session: aiohttp.ClientSession, url: str) -> bool:
    with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
        async with session.get(url + "/health") as resp:
            return resp.status in SERVER_STATUSES
    return False


async def local_server(urls: list[str] | None = None) -> list[str]:
    """The first of `urls` (default: both default ports) whose /health answers as
    llama-server's does, as a one-item list; [] when none does."""
    urls = urls if urls is not None else default_urls()
    timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        found = await asyncio.gather(*(_answers(session, url) for url in urls))
    return [url for url, ok in zip(urls, found, strict=True) if ok][:1]
