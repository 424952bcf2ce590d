"""The behavioural probe: what a server computes for a fixed prompt, as part of its identity.

Where neither GET /props nor the server's flags tell what changed (a server on another host,
another build of llama.cpp, a flag given some way kvproxy cannot read), the numbers do: the
next-token distribution after a fixed prompt (its `TOP_K` most likely tokens and their
log-probabilities, read from the full distribution: `n_probs`, no sampler) changes with the
weights, the adapters applied, the rope settings, metadata overrides and the maths of the
build. One prompt of a few dozen tokens and one generated token, after every start of a
server.

The numbers are compared with a tolerance, not exactly: a server computes a prompt slightly
differently in another batch shape (measured: log-probabilities move by ~5e-4 when the
ubatch size changes, ~2e-4 with flash attention off), so two runs of one configuration need
not agree to the last digit. A change below `TOLERANCE` is one the server itself makes
between requests, and a state computed either way is as good. `ProbeBook` keeps the
behaviours seen per server configuration in the cache dir, each under a stable id: a server
whose probe falls within the tolerance of one seen before gets its id (and its states), any
other a new one.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import xxhash

from kvproxy.server.api import LlamaClient
from kvproxy.store import dirfiles

PROMPT = (
    "Kvproxy probe. The seven brown foxes counted 3, 14, 159 and 2653 river stones before "
    "noon; then they wrote:"
)
TOP_K = 8
TOLERANCE = 0.02
BOOK = "probes.json"
BOOK_LOCK = ".probes.lock"
MAX_CONFIGS = 256  # configurations remembered in the book (the most recent win)
MAX_BEHAVIOURS = 8  # behaviours remembered per configuration


@dataclass(frozen=True)
class Behaviour:
    """The most likely next tokens after `PROMPT`, most likely first: (id, log-probability)."""

    top: tuple[tuple[int, float], ...]

    def matches(self, other: Behaviour, tolerance: float = TOLERANCE) -> bool:
        """Within `tolerance` of each other: the same tokens clearly inside the top (a token
        near the edge may swap with its neighbour), and each shared one as likely."""
        if not self.top or len(self.top) != len(other.top):
            return False
        mine, theirs = dict(self.top), dict(other.top)
        for a, b in ((mine, theirs), (theirs, mine)):
            edge = min(a.values()) + tolerance
            for token, logprob in a.items():
                if token in b:
                    if abs(logprob - b[token]) > tolerance:
                        return False
                elif logprob > edge:
                    return False
        return True

    def to_json(self) -> list[list[float]]:
        return [[t, lp] for t, lp in self.top]

    @classmethod
    def from_json(cls, raw: Any) -> Behaviour | None:
        try:
            return cls(tuple((int(t), float(lp)) for t, lp in raw))
        except (TypeError, ValueError):
            return None


# The token generated must be printable text: the server leaves the probabilities out of a
# reply whose token is part of a character. They are read before the grammar applies.
PRINTABLE = "root ::= [ -~]+"


def probe_body(slot_id: int) -> dict[str, Any]:
    """The probe request: pinned to a slot kvproxy then forgets; the slot's cache unused."""
    return {
        "prompt": PROMPT,
        "n_predict": 1,
        "n_probs": TOP_K,
        "temperature": 0,
        "grammar": PRINTABLE,
        "id_slot": slot_id,
        "cache_prompt": False,
    }


async def behaviour(client: LlamaClient, slot_id: int) -> Behaviour | None:
    """Run the probe on a slot (the caller owns it and forgets what it held). None when the
    server gives no probabilities."""
    reply = await client.complete(probe_body(slot_id), timeout=600.0)
    return read_reply(reply)


def read_reply(reply: dict[str, Any]) -> Behaviour | None:
    probs = reply.get("completion_probabilities")
    if not isinstance(probs, list) or not probs or not isinstance(probs[0], dict):
        return None
    top = probs[0].get("top_logprobs")
    if not isinstance(top, list):
        return None
    pairs = []
    for item in top:
        if isinstance(item, dict) and isinstance(item.get("id"), int):
            logprob = item.get("logprob")
            if isinstance(logprob, int | float):
                pairs.append((int(item["id"]), float(logprob)))
    pairs.sort(key=lambda p: -p[1])
    return Behaviour(tuple(pairs)) if pairs else None


# --- the book of behaviours seen


def classify(known: Sequence[Behaviour], seen: Behaviour) -> tuple[str, list[Behaviour]]:
    """The id of the first known behaviour `seen` matches (else its own, added): ids are a
    digest of the behaviour first seen, so every kvproxy reading the book agrees on them."""
    for old in known:
        if old.matches(seen):
            return behaviour_id(old), list(known)
    return behaviour_id(seen), [*known, seen][-MAX_BEHAVIOURS:]


def behaviour_id(b: Behaviour) -> str:
    return xxhash.xxh3_64_hexdigest(orjson.dumps(b.to_json()))


def class_of(root: Path, config: str, seen: Behaviour) -> str:
    """`classify` against the cache dir's book for `config` (a digest of what else
    identifies the server), the book updated under a lock shared with other kvproxy."""
    with _locked(root):
        book = dirfiles.read(root, BOOK)
        book = book if isinstance(book, dict) else {}
        raw = book.pop(config, [])
        known = [b for b in map(Behaviour.from_json, raw if isinstance(raw, list) else []) if b]
        found, known = classify(known, seen)
        book[config] = [b.to_json() for b in known]  # last: the most recently used
        while len(book) > MAX_CONFIGS:
            book.pop(next(iter(book)))
        dirfiles.write(root, BOOK, book)
        return found


@contextlib.contextmanager
def _locked(root: Path) -> Iterator[None]:
    fd = os.open(root / BOOK_LOCK, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
