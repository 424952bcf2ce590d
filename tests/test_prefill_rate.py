"""The prefill time a cache hit saved: its cached tokens at the server's measured cold-prefill
speed, less the restore; no estimate before a cold prefill was seen."""

from __future__ import annotations

import pytest

from kvproxy.cache.decisions.policy import Decision
from kvproxy.cache.decisions.prefillrate import WINDOW, PrefillRates
from kvproxy.cache.reports.events import Events, RequestEvent
from kvproxy.cli.stats import render_stats
from kvproxy.obs.recent import Recent
from kvproxy.obs.requestlog import format_request

CHAT = "/v1/chat/completions"


def test_no_cold_prefill_seen_means_no_estimate() -> None:
    rates = PrefillRates()
    # A cache hit's own few tokens are no price for its cached ones.
    rates.observe("m", cache_n=4000, prompt_n=30, prompt_ms=90.0)
    rates.observe("m", cache_n=4000, prompt_n=600, prompt_ms=900.0)  # mostly cached
    assert rates.ms_per_token("m") is None
    assert rates.saved_s("m", cache_n=4000) is None


def test_cold_prefills_price_the_cached_tokens() -> None:
    rates = PrefillRates()
    rates.observe("m", cache_n=0, prompt_n=1000, prompt_ms=3000.0)  # 3 ms a token
    rates.observe("m", cache_n=100, prompt_n=3000, prompt_ms=12000.0)  # 4 ms a token
    rates.observe("m", cache_n=4000, prompt_n=20, prompt_ms=600.0)  # a hit: not a price
    assert rates.ms_per_token("m") == pytest.approx(15000 / 4000)
    # 4000 cached tokens at 3.75 ms, less a 50 ms restore.
    assert rates.saved_s("m", cache_n=4000, restore_ms=50.0) == pytest.approx(14.95)
    assert rates.saved_s("m", cache_n=0, restore_ms=50.0) == 0.0  # a useless restore
    assert rates.saved_s("other", cache_n=4000) is None  # each model its own price


def test_the_price_follows_the_latest_cold_prefills() -> None:
    rates = PrefillRates()
    rates.observe("m", cache_n=0, prompt_n=1000, prompt_ms=10000.0)
    for _ in range(WINDOW):
        rates.observe("m", cache_n=0, prompt_n=1000, prompt_ms=2000.0)
    assert rates.ms_per_token("m") == pytest.approx(2.0)


def test_a_hit_is_priced_at_the_cold_speed_not_at_its_own() -> None:
    """Before: 4000 cached tokens at the hit's own 30 ms a token said 120 s saved."""
    events, recent = Events(), Recent(clock=lambda: 1000.0)
    events.listeners.append(recent)
    hit = RequestEvent(
        CHAT, Decision.RESIDENT, 200, "k" * 16, cache_n=4000, prompt_n=10, prompt_ms=300.0
    )
    events.request(hit)
    assert hit.prefill_saved_s is None and "saved" not in format_request(hit)
    assert recent.snapshot()["last_hour"]["prefill_seconds_saved"] is None  # the page shows "—"
    cold = RequestEvent(CHAT, Decision.MISS, 200, "c" * 16, cache_n=0, prompt_n=2000)
    cold.prompt_ms = 6000.0  # 3 ms a token
    events.request(cold)
    again = RequestEvent(
        CHAT, Decision.RESTORED, 200, "k" * 16, cache_n=4000, prompt_n=10, prompt_ms=300.0
    )
    again.restore_ms = 20.0
    events.request(again)
    assert again.prefill_saved_s == pytest.approx(11.98)
    assert "saved≈12.0s" in format_request(again)
    assert recent.snapshot()["last_hour"]["prefill_seconds_saved"] == pytest.approx(11.98)


def test_kvproxys_own_evaluations_price_cached_tokens_too() -> None:
    """A new conversation's opening is prefilled by kvproxy's own evaluation (to save it on
    the way), so its reply prefills only a few tokens: that evaluation is the cold prefill."""
    events = Events()
    events.prefilled("m", {"cache_n": 0, "prompt_n": 4918, "prompt_ms": 49180.0})
    events.prefilled("m", {"cache_n": 4900, "prompt_n": 300, "prompt_ms": 9000.0})  # not cold
    events.prefilled("m", {})  # a reply without timings
    hit = RequestEvent(CHAT, Decision.RESIDENT, 200, "k" * 16, cache_n=4941, prompt_n=32)
    hit.prompt_ms = 800.0
    hit.served_by = "m"
    events.request(hit)
    assert hit.prefill_saved_s == pytest.approx(49.41)


def test_kvproxy_stats_shows_a_dash_before_an_estimate() -> None:
    before = render_stats({"prefill_seconds_saved": None, "prefill_seconds": 1.5}, "u")
    assert "saved ≈ —, spent 1.5 s" in before
    after = render_stats({"prefill_seconds_saved": 12.34, "prefill_seconds": 1.5}, "u")
    assert "saved ≈ 12.3 s, spent 1.5 s" in after
