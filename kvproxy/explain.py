"""Explaining misses: where a request parted from the closest conversation the cache knew."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .events import MissExplanation


def explain_miss(
    messages: list[Any], candidates: Iterable[tuple[str, list[Any]]]
) -> MissExplanation | None:
    """`candidates`: (where, messages) of conversations in the same namespace. Not built yet."""
    del messages, candidates
    return None
