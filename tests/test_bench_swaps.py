"""`kvproxy bench swaps`' table, on a result made by hand: later turns judged against the
ideal, the summary's ratio to the router alone."""

from __future__ import annotations

from dataclasses import asdict

from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY
from kvproxy_bench.swaps import SwapsOptions, SwapsResult, Turn, markdown


def test_the_table_judges_turns_after_a_swap_and_compares_the_arms() -> None:
    result = SwapsResult(options=asdict(SwapsOptions(turns=2)))
    for arm, cached, seconds in ((DIRECT_RAM_CACHE, 0, 20.0), (KVPROXY, 1500, 2.0)):
        for model in ("coder", "chat"):
            result.turns.append(Turn(arm, model, 1, 0, 1500, 0, 20.0, "miss"))
            result.turns.append(
                Turn(arm, model, 2, cached, 1540 - cached, 1500, seconds, "restored")
            )
    text = markdown(result)
    assert "turns A1 B1 A2 B2: every turn swaps the model" in text
    assert "coder 2" in text and "chat 2" in text
    summary = text.split("together:")[1]
    assert "100.0%" in summary and "10.0×" in summary
    assert "0.0%" in summary  # the router alone lost both models' KV at every swap
