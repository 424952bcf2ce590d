"""Deterministic conversations for the benchmarks (the same generator the tests use)."""

from __future__ import annotations

import random
from typing import Any

ADJECTIVES = ["red", "quiet", "ancient", "bright", "hollow", "gentle", "rapid", "frozen"]
NOUNS = ["river", "lantern", "harbor", "meadow", "engine", "library", "garden", "tower"]
# One fact is about 21 tokens with Gemma's tokenizer; the header adds about 12.
TOKENS_PER_FACT = 21.5


def system_prompt(conversation: int, n_facts: int = 65) -> str:
    """65 facts is ~1,400 tokens with Gemma's tokenizer."""
    rng = random.Random(conversation)
    facts = [
        f"Fact {i}: the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} of project "
        f"{conversation} weighs {rng.randint(10, 9999)} grams."
        for i in range(n_facts)
    ]
    return f"You are assistant {conversation}. Remember these facts.\n" + "\n".join(facts)


def facts_for(tokens: int) -> int:
    """Roughly how many facts make a system prompt of `tokens` tokens."""
    return max(1, round((tokens - 40) / TOKENS_PER_FACT))


def first_turn(conversation: int, n_facts: int = 65) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": system_prompt(conversation, n_facts)},
        {"role": "user", "content": f"What does fact 3 of project {conversation} say?"},
    ]


def question(turn: int) -> str:
    """The user message of turn `turn` (2, 3, …): short, like a real follow-up."""
    return f"And what does fact {turn + 3} say?"


def next_turn(messages: list[dict[str, Any]], reply: str, turn: int) -> list[dict[str, Any]]:
    """The client echoes the assistant's reply, then asks the next question."""
    return [
        *messages,
        {"role": "assistant", "content": reply},
        {"role": "user", "content": question(turn)},
    ]
