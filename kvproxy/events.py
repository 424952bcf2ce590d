"""What the cache reports about its work, for metrics and the per-request log line.

The cache calls every listener synchronously on the event loop; listeners must be quick and
must not raise (an exception is logged and dropped so a listener bug never fails a request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class MissExplanation:
    """Where a request parted from the closest conversation the cache knew."""

    message_index: int  # first message that differs
    char_offset: int  # first differing character in that message's text
    ours: str  # short excerpt of the request's text around the divergence
    theirs: str  # the same excerpt of the known conversation
    where: str  # "slot N" or "disk"


@dataclass
class RequestEvent:
    """One request through the proxy, after its reply was relayed."""

    route: str
    decision: str  # resident | restored | miss | bypass
    status: int
    key: str = ""  # conversation key (hex), "" when the request was not keyed
    slot: int | None = None
    queue_wait_s: float = 0.0
    duration_s: float = 0.0
    restored_tokens: int = 0
    restore_ms: float = 0.0
    cache_n: int | None = None  # from the reply's `timings`, when it had them
    prompt_n: int | None = None
    prompt_ms: float | None = None
    miss: MissExplanation | None = None


@dataclass
class SlotActionEvent:
    """A save or restore kvproxy asked the server for."""

    action: str  # save | restore
    ok: bool
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0


class Listener(Protocol):
    def on_request(self, event: RequestEvent) -> None: ...

    def on_slot_action(self, event: SlotActionEvent) -> None: ...
