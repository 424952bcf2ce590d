"""The fake llama-server lives in kvproxy_fake (bench/kvproxy_fake) (benchmarks run it too); these are the names
the tests import from here."""

from typing import Any

import orjson
from kvproxy_fake.model import BOS, EOS, common_prefix, render_chat, tokenize
from kvproxy_fake.server import FakeLlamaServer

from kvproxy.server import probe
from kvproxy.server.fingerprint import TEMPLATE_PROBE

__all__ = [
    "BOS",
    "EOS",
    "FakeLlamaServer",
    "clients",
    "common_prefix",
    "fingerprinting",
    "render_chat",
    "tokenize",
]


def clients(requests: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """A fake server's `requests` but kvproxy's own fingerprinting (`fingerprinting`)."""
    return [r for r in requests if not fingerprinting(r[0], r[1], orjson.dumps(r[2]))]


def fingerprinting(method: str, path: str, body: bytes) -> bool:
    """Is this kvproxy reading a server's fingerprint (server/fingerprint.py) when it sees a
    server start, not a client's request? Stand-ins that record what reaches them leave
    these out."""
    if method == "GET" and path == "/lora-adapters":
        return True
    return method == "POST" and (
        probe.PROMPT.encode() in body or TEMPLATE_PROBE[0]["content"].encode() in body
    )
