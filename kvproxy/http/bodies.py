"""Request bodies as llama-server reads them, and whether kvproxy can work with one.

The server parses bodies with nlohmann::json; kvproxy with orjson, which is stricter in two
ways: it refuses a leading UTF-8 BOM (the server skips it) and nesting beyond 1,024 levels
(the server has no limit). orjson also writes at most 254 levels, and the wire converters
copy bodies recursively. So a body kvproxy cannot parse although it may be JSON, or nests
too deep to be written back, is `opaque`: it goes to the server as it came, while kvproxy
holds every slot (the server then picks one itself), and what the server says is what the
client gets.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

BOM = b"\xef\xbb\xbf"
# Deepest nesting kvproxy parses, walks and writes back; beyond it a body is opaque. Well
# below orjson's writing limit (254), and leaves Python's recursion limit to the copies.
MAX_DEPTH = 128


@dataclass(frozen=True)
class Body:
    """A parsed request body: `value` when kvproxy can work with it; else `invalid` (why it
    is not JSON: the server refuses it before any slot) or opaque (neither)."""

    value: Any = None
    usable: bool = False
    invalid: str | None = None

    @property
    def opaque(self) -> bool:
        return not self.usable and self.invalid is None


def parse(body: bytes) -> Body:
    data = body[len(BOM) :] if body.startswith(BOM) else body
    try:
        value = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return _second_opinion(data, str(exc))
    if deeper_than(value, MAX_DEPTH, data):
        return Body()
    return Body(value, usable=True)


def let_go(request: web.Request) -> None:
    """Drops the raw bytes aiohttp keeps of a body read whole (`request.read()` caches them for
    the request's life), once kvproxy holds the body parsed and sends it rewritten from that:
    otherwise every queued body is held twice (edge/heldbodies.py). The caller must hold no
    reference either, and nothing may read the body from the request after this."""
    request._read_bytes = None  # aiohttp's cache of read(): a body is read once, here


def _second_opinion(data: bytes, error: str) -> Body:
    """orjson refused `data`: invalid only if the standard library's parser refuses it too
    for a reason other than depth (both then agree with the server's)."""
    try:
        json.loads(data.decode("utf-8"))
    except RecursionError:
        return Body()
    except ValueError:  # UnicodeDecodeError included
        return Body(invalid=error)
    return Body()


def deeper_than(value: Any, limit: int, raw: bytes | None = None) -> bool:
    """Whether `value` nests more than `limit` arrays and objects deep; without a walk when
    its text `raw` has too few brackets to nest that deep."""
    if raw is not None and raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    if not isinstance(value, dict | list):
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        for child in node.values() if isinstance(node, dict) else node:
            if isinstance(child, dict | list):
                if depth >= limit:
                    return True
                stack.append((child, depth + 1))
    return False


def refused_encoding(content_encoding: str | None) -> str | None:
    """The request's `Content-Encoding` if kvproxy refuses it, else None.

    llama-server reads request bodies with cpp-httplib, which inflates gzip/deflate (br,
    zstd) only when built with that library (CPPHTTPLIB_ZLIB_SUPPORT, ...); the bundled build
    links no zlib, so it answers 415 to them, and aiohttp would inflate them before kvproxy
    saw the bytes, past --max-body and under the original Content-Length. So the rule, on
    every route kvproxy forwards: a body is sent as it is (no header, or `identity`), and any
    other Content-Encoding is a 415 before a byte of the body is read.
    """
    if content_encoding is None:
        return None
    codings = [c.strip().lower() for c in content_encoding.split(",")]
    if all(c in ("", "identity") for c in codings):
        return None
    return content_encoding.strip() or None
