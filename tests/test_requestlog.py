"""One log line per request, plain or JSON (--log-json makes every record JSON)."""

from __future__ import annotations

import asyncio
import logging
import queue
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest

from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.reports.events import MissExplanation, RequestEvent
from kvproxy.cli import setup_logging
from kvproxy.cli.flags import load_settings
from kvproxy.cli.logwriter import LogWriter
from kvproxy.obs.requestlog import JsonFormatter, format_request, request_fields

from .conftest import Maker, RunningProxy
from .test_cache import chat, conv, settle, then

KEY = "3fa9c1e2b7d04e5f8a9b0c1d2e3f4a5b"


def test_plain_line() -> None:
    event = RequestEvent(
        route="/v1/chat/completions",
        decision=Decision.RESTORED,
        status=200,
        key=KEY,
        slot=1,
        duration_s=1.83,
        restored_tokens=1432,
        restore_ms=6.1,
        cache_n=1432,
        prompt_n=31,
        prompt_ms=90.9,
        prefill_saved_s=4.2,  # priced by the server's cold prefills (Events sets it)
    )
    assert format_request(event) == (
        "chat 3fa9c1e2b7d0 restored slot=1 restored=1432tok/6.1ms cache_n=1432 prompt_n=31 "
        "saved≈4.2s status=200 1.8s"
    )
    event.prefill_saved_s = None  # no cold prefill seen yet: no guess
    assert "saved" not in format_request(event)
    bypass = RequestEvent("/v1/messages", Decision.BYPASS, 502, duration_s=0.05)
    assert format_request(bypass) == "/v1/messages bypass status=502 50ms"
    waited = RequestEvent("/chat/completions", Decision.MISS, 200, KEY, 0, queue_wait_s=0.5)
    assert format_request(waited) == "chat 3fa9c1e2b7d0 miss slot=0 wait=500ms status=200 0.0ms"


def test_plain_line_at_big_state_sizes() -> None:
    """An 8B model's 8k-token conversation: seconds and minutes, not thousands of ms."""
    event = RequestEvent(
        "/v1/chat/completions",
        Decision.RESTORED,
        200,
        KEY,
        0,
        duration_s=192.4,
        queue_wait_s=34.2,
        restored_tokens=8377,
        restore_ms=2431.7,
        cache_n=8377,
        prompt_n=12,
        prefill_saved_s=1234.5,
    )
    assert format_request(event) == (
        "chat 3fa9c1e2b7d0 restored slot=0 restored=8377tok/2.4s cache_n=8377 prompt_n=12 "
        "saved≈20.6min wait=34.2s status=200 3.2min"
    )


def test_json_formatter_carries_the_fields() -> None:
    miss = MissExplanation(0, 57, "…12:0‖3:44…", "…12:0‖1:07…", "slot 1")
    event = RequestEvent("/v1/chat/completions", Decision.MISS, 200, KEY, 1, cache_n=0, miss=miss)
    record = logging.makeLogRecord(
        {"name": "kvproxy.request", "levelno": 20, "levelname": "INFO", "msg": "line"}
    )
    record.fields = request_fields(event)
    out = orjson.loads(JsonFormatter().format(record))
    assert out["message"] == "line" and out["level"] == "info"
    assert out["logger"] == "kvproxy.request" and out["time"].endswith("Z")
    assert out["decision"] == "miss" and out["key"] == KEY[:12] and out["slot"] == 1
    assert out["miss"]["char_offset"] == 57 and out["miss"]["where"] == "slot 1"
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        failed = logging.makeLogRecord({"msg": "failed", "exc_info": sys.exc_info()})
    assert "RuntimeError: boom" in orjson.loads(JsonFormatter().format(failed))["exc"]


async def request_lines(caplog: pytest.LogCaptureFixture, proxy: RunningProxy, n: int) -> list[Any]:
    """The log records of the request lines (LogRecords with a `fields` attribute set)."""
    for _ in range(300):
        await settle(proxy)
        lines = [r for r in caplog.records if r.name == "kvproxy.request"]
        if len(lines) >= n:
            return lines
        await asyncio.sleep(0.01)
    raise AssertionError(f"expected {n} request lines: {caplog.text}")


async def test_one_line_per_request(make: Maker, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvproxy.request")
    fake, proxy = await make()
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    _, body, h = await chat(proxy, then(conv(1), replies[1]))
    assert h["X-KVProxy-Cache"] == "restored"
    records = await request_lines(caplog, proxy, 4)
    assert len(records) == 4
    assert [r.fields["decision"] for r in records] == ["miss", "miss", "miss", "restored"]
    last = records[-1].getMessage()
    timings = body["timings"]
    assert last.startswith("chat ")
    assert f" restored slot={records[-1].fields['slot']} " in last
    assert f" restored={h['X-KVProxy-Restored-Tokens']}tok/" in last
    assert f" cache_n={timings['cache_n']} prompt_n={timings['prompt_n']} saved≈" in last
    assert " status=200 " in last
    # Priced at the three cold misses' prefill speed, less the restore.
    cold = [r.fields for r in records[:3]]
    rate = sum(f["prompt_ms"] for f in cold) / sum(f["prompt_n"] for f in cold)
    restore_ms = records[-1].fields["restore_ms"]
    assert records[-1].fields["prefill_saved_s"] == pytest.approx(
        max(timings["cache_n"] * rate - restore_ms, 0) / 1000, abs=1e-3
    )


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root, llama = logging.getLogger(), logging.getLogger("llama-server")
    saved = (list(root.handlers), root.level, list(llama.handlers), llama.propagate)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    llama.handlers[:], llama.propagate = saved[2], saved[3]


def test_log_json_makes_every_record_json(
    restore_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    writer = setup_logging("info", json_lines=True)
    logging.getLogger("kvproxy.cache").info("saved slot %d", 1)
    logging.getLogger("llama-server").info("srv  load_model: loading")
    logging.getLogger("kvproxy.request").info("chat x miss", extra={"fields": {"slot": 0}})
    writer.stop()  # written by a thread of their own: all of them now, in order
    lines = capsys.readouterr().err.strip().splitlines()
    records = [orjson.loads(line) for line in lines]
    assert [r["logger"] for r in records] == ["kvproxy.cache", "llama-server", "kvproxy.request"]
    assert records[0]["message"] == "saved slot 1" and records[2]["slot"] == 0


def test_log_json_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings({}).log_json is False
    assert load_settings({"log_json": True}).log_json is True
    monkeypatch.setenv("KVPROXY_LOG_JSON", "1")
    assert load_settings({}).log_json is True


def test_the_line_says_what_kvproxy_computed_for_the_request() -> None:
    """An opening evaluated on the way is computed for the request, though the reply's
    cache_n counts it: the line and the JSON fields say how many tokens."""
    event = RequestEvent(
        "/v1/chat/completions", Decision.MISS, 200, key="ab" * 16, slot=0, cache_n=0, prompt_n=25
    )
    event.evaluated = 1514
    assert "prompt_n=25 evaluated=1514" in format_request(event)
    assert request_fields(event)["evaluated"] == 1514


def test_log_writer_writes_a_batch_in_one_write_in_order() -> None:
    """Each write gives up the GIL and takes it back from the event loop: a batch of lines
    goes out in one write per stream, in the order the records came, filters applied."""

    class Stream:
        def __init__(self) -> None:
            self.writes: list[str] = []

        def write(self, text: str) -> None:
            self.writes.append(text)

        def flush(self) -> None:
            pass

    stream = Stream()
    ours = logging.StreamHandler(stream)
    ours.addFilter(lambda r: r.name != "llama-server")
    theirs = logging.StreamHandler(stream)
    theirs.setFormatter(logging.Formatter("llama: %(message)s"))
    theirs.addFilter(lambda r: r.name == "llama-server")
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    writer = LogWriter(records, ours, theirs, interval=60)
    writer.start()
    for name, message in [("kvproxy", "one"), ("llama-server", "two"), ("kvproxy", "three")]:
        records.put(logging.LogRecord(name, logging.INFO, __file__, 1, message, None, None))
    writer.stop()
    assert stream.writes == ["one\nllama: two\nthree\n"]
