"""A keyed request's body: read, parsed, and held once while it waits for a slot.

aiohttp keeps the raw bytes of a body read whole for the request's life; kvproxy parses them.
A queued body was so held twice (2x its size; 32 queued 30 MiB chats took 2.25 GiB). A body
read as a conversation goes out written from its parse (`id_slot` added), so its raw bytes
are let go there (`Incoming.let_go`): a queued chat then costs its parse alone.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import orjson
from aiohttp import web

from kvproxy.http import bodies as jsonbody
from kvproxy.http.errors import error_response


@dataclass
class Incoming:
    """A keyed request's body as it came (None once let go), parsed, and when it came."""

    body: bytes | None
    parsed: jsonbody.Body
    started: float

    def raw(self) -> bytes:
        """The body to send as it is: as it came, or written back from the parse (the same
        JSON: a body that is let go parsed usable) after `let_go`."""
        return self.body if self.body is not None else orjson.dumps(self.parsed.value)

    def let_go(self, request: web.Request) -> None:
        """Keep the parsed body only: the raw one, here and aiohttp's, is a second copy of
        the body while it waits for a slot (a conversation goes out written from the parse)."""
        if self.parsed.usable:
            self.body = None
            jsonbody.let_go(request)


async def read_incoming(request: web.Request) -> Incoming | web.Response:
    """The request's body read and parsed, or the 400 for a body that is not JSON."""
    started = time.perf_counter()
    body = await request.read()
    parsed = jsonbody.parse(body)
    if parsed.invalid is not None:
        return invalid_json(parsed.invalid)
    return Incoming(body, parsed, started)


def invalid_json(reason: str) -> web.Response:
    return error_response(400, f"Request body is not valid JSON: {reason}", "invalid_json")
