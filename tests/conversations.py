"""Deterministic long conversations for end-to-end tests and benchmarks."""

from __future__ import annotations

import random

ADJECTIVES = ["red", "quiet", "ancient", "bright", "hollow", "gentle", "rapid", "frozen"]
NOUNS = ["river", "lantern", "harbor", "meadow", "engine", "library", "garden", "tower"]


def system_prompt(conversation: int, n_facts: int = 65) -> str:
    """About 21 tokens a fact: 65 facts is ~1,400 tokens with Gemma's tokenizer."""
    rng = random.Random(conversation)
    facts = [
        f"Fact {i}: the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} of project "
        f"{conversation} weighs {rng.randint(10, 9999)} grams."
        for i in range(n_facts)
    ]
    return f"You are assistant {conversation}. Remember these facts.\n" + "\n".join(facts)


def first_turn(conversation: int, n_facts: int = 65) -> list[dict]:
    return [
        {"role": "system", "content": system_prompt(conversation, n_facts)},
        {"role": "user", "content": f"What does fact 3 of project {conversation} say?"},
    ]
