"""One log line per request, and JSON logging (`--log-json`).

Plain text (the default):

    chat 3fa9c1e2b7d0 restored slot=1 restored=1432tok/6.1ms cache_n=1432 prompt_n=31
        saved≈4.2s status=200 1.8s

With `--log-json` every log record (not only these) is one JSON object per line; request
lines carry their numbers as fields, so a log shipper needs no parsing.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson

from kvproxy import readable
from kvproxy.cache.reports.events import Count, MissExplanation, RequestEvent, SlotActionEvent
from kvproxy.cache.reports.explain import describe

log = logging.getLogger("kvproxy.request")

CHAT_ROUTES = frozenset({"/v1/chat/completions", "/chat/completions"})


class RequestLog:
    """A cache listener that logs each request on `kvproxy.request` at INFO."""

    def on_request(self, event: RequestEvent) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        fields = request_fields(event)
        log.info(format_request(event, fields), extra={"fields": fields})
        if event.weak is not None:
            log.info(
                "weak hit: %s %s reused %s of ~%s expected tokens: %s",
                fields["key"] or "-",
                event.decision,
                event.cache_n,
                event.expected_n,
                describe(event.weak),
                extra={
                    "fields": {
                        "event": "weak_hit",
                        "key": fields["key"],
                        "why": describe(event.weak),
                    }
                },
            )
        if event.miss is not None:
            log.info(
                "miss explained: %s %s",
                fields["key"] or "-",
                describe(event.miss),
                extra={"fields": {"event": "miss_explained", "key": fields["key"]}},
            )

    def on_slot_action(self, event: SlotActionEvent) -> None:
        # Saves and restores are logged where they happen (kvproxy/cache/slotio/slotwork.py).
        del event

    def on_count(self, what: Count, n: int) -> None:
        del what, n


def request_fields(event: RequestEvent) -> dict[str, Any]:
    saved = event.prefill_saved_s
    fields: dict[str, Any] = {
        "event": "request",
        "route": event.route,
        "key": event.key[:12],
        "decision": event.decision,
        "slot": event.slot,
        "backend": event.backend,
        "status": event.status,
        "duration_s": round(event.duration_s, 4),
        "queue_wait_s": round(event.queue_wait_s, 4),
        "restored_tokens": event.restored_tokens,
        "restore_ms": round(event.restore_ms, 2),
        "cache_n": event.cache_n,
        "prompt_n": event.prompt_n,
        "prompt_ms": event.prompt_ms,
        "evaluated": event.evaluated,
        "prefill_saved_s": None if saved is None else round(saved, 4),
        "expected_n": event.expected_n,
    }
    if event.miss is not None:
        fields["miss"] = _miss_fields(event.miss)
    return fields


def _miss_fields(miss: MissExplanation) -> dict[str, Any]:
    return {
        "where": miss.where,
        "message_index": miss.message_index,
        "char_offset": miss.char_offset,
        "ours": miss.ours,
        "theirs": miss.theirs,
    }


def format_request(event: RequestEvent, fields: dict[str, Any] | None = None) -> str:
    fields = fields if fields is not None else request_fields(event)
    route = "chat" if event.route in CHAT_ROUTES else event.route
    parts = [route]
    if event.key:
        parts.append(fields["key"])
    parts.append(event.decision)
    if event.slot is not None:
        parts.append(f"slot={event.slot}")
    if event.backend is not None:
        parts.append(f"backend={event.backend}")
    if event.decision == "restored":
        parts.append(f"restored={event.restored_tokens}tok/{_t(event.restore_ms / 1000)}")
    if event.cache_n is not None:
        parts.append(f"cache_n={event.cache_n}")
    if event.prompt_n is not None:
        parts.append(f"prompt_n={event.prompt_n}")
    if event.evaluated:
        parts.append(f"evaluated={event.evaluated}")
    saved = fields["prefill_saved_s"]
    if saved is not None and event.cache_n:
        parts.append(f"saved≈{_t(saved)}")
    if event.queue_wait_s >= 0.01:
        parts.append(f"wait={_t(event.queue_wait_s)}")
    parts.append(f"status={event.status}")
    parts.append(_t(event.duration_s))
    return " ".join(parts)


def _t(seconds: float) -> str:
    return readable.duration(seconds, sep="")


# Attributes every LogRecord has; anything else came in through `extra=`.
_STANDARD = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, plus the record's `fields`
    (request lines) and any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _iso(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for name, value in fields.items():
                out.setdefault(name, value)
        for name, value in record.__dict__.items():
            if name not in _STANDARD and name != "fields" and name not in out:
                out[name] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=str).decode()


def _iso(created: float) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
    return f"{seconds}.{int(created % 1 * 1000):03d}Z"
