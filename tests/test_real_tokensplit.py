"""The canonical prefix tokenised head-once (tokensplit.py) is token for token the one every
render tokenised in full gives, on a real llama-server: Gemma 3 270M with a Gemma-style
template (its <start_of_turn> markers are control tokens), the tiny generated GGUFs' ChatML
template and SPM vocabulary, and the bundled Gemma as the tests and benchmarks run it (its
GGUF has no template, so the server renders ChatML, whose markers are plain text to Gemma:
the full path must be taken). Conversations with tool calls, multi-part content, long
texts, unicode and replies ending in whitespace."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from kvproxy_bench.canonical_cost import GEMMA_TEMPLATE, CountingClient
from kvproxy_bench.dialogues import system_prompt

from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.canonical import tokensplit
from kvproxy.http.session import Upstream

from .conftest import RealServer, start_real_server

pytestmark = pytest.mark.real

LONG = system_prompt(3, n_facts=200)  # ~5k tokens
UNICODE = "Grüße aus Köln — 東京の天気は？ 🌧️ naïve café, ½ ≠ ¾, עברית, Ελληνικά."
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'},
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def conversations() -> list[tuple[str, dict[str, Any], list[dict[str, Any]], str | None]]:
    """(name, template fields, messages ending with the reply, echo style)."""
    sys_user = [{"role": "system", "content": LONG}, {"role": "user", "content": "Fact 7?"}]
    return [
        ("plain", {}, [*sys_user, {"role": "assistant", "content": "Fact 7 is blue."}], None),
        (
            "whitespace reply",
            {},
            [*sys_user, {"role": "assistant", "content": "\nIt is blue.  \n"}],
            None,
        ),
        (
            "whitespace, verbatim",
            {},
            [*sys_user, {"role": "assistant", "content": "\nIt is blue.  \n"}],
            canonical.VERBATIM,
        ),
        (
            "unicode",
            {},
            [
                {"role": "user", "content": UNICODE * 40},
                {"role": "assistant", "content": UNICODE},
                {"role": "user", "content": "¿Y mañana? " + UNICODE},
                {"role": "assistant", "content": "🌞 " + UNICODE + " "},
            ],
            None,
        ),
        (
            "multi-part",
            {},
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": LONG},
                        {"type": "text", "text": "Which shelf? <b>bold</b> <not a tag>"},
                    ],
                },
                {"role": "assistant", "content": "Shelf <3>."},
            ],
            None,
        ),
        (
            "tool calls",
            {"tools": TOOLS},
            [
                *sys_user,
                {"role": "assistant", "content": None, "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
                {"role": "assistant", "content": "21 degrees in Paris."},
            ],
            None,
        ),
        (
            "tool call last",
            {"tools": TOOLS},
            [*sys_user, {"role": "assistant", "content": "", "tool_calls": [CALL]}],
            None,
        ),
    ]


@pytest.fixture
async def client_for() -> AsyncIterator[Any]:
    upstreams: list[Upstream] = []

    async def make(url: str) -> CountingClient:
        upstream = Upstream(url)
        await upstream.start()
        upstreams.append(upstream)
        return CountingClient(upstream)

    yield make
    for upstream in upstreams:
        await upstream.close()


@pytest.fixture
def gemma_template(cache_dir: Path) -> Iterator[RealServer]:
    template = cache_dir.parent / "gemma.jinja"
    template.write_text(GEMMA_TEMPLATE)
    extra = ("--cache-ram", "0", "--chat-template-file", str(template))
    server = start_real_server(cache_dir, slots=1, extra=extra)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def tiny_chatml(cache_dir: Path, tiny_models: dict[str, Path]) -> Iterator[RealServer]:
    server = start_real_server(cache_dir, tiny_models["dense"], slots=1, extra=("--cache-ram", "0"))
    try:
        yield server
    finally:
        server.stop()


async def compare(client: CountingClient, expect_split: bool) -> list[str]:
    """Old and new canonical prefixes of every conversation; returns the names compared."""
    compared = []
    for name, fields, messages, style in conversations():
        old = await canonical.prefix_tokens(
            client, fields, messages, style, tokenize=tokensplit.tokenize_each
        )
        client.special_texts.clear()
        new = await canonical.prefix_tokens(client, fields, messages, style)
        assert new == old, name
        if old is None:
            continue
        compared.append(name)
        # The long renders were tokenised in full once (the head), or each (the fallback).
        long_ones = [n for n in client.special_texts if n > 1000]
        if expect_split:
            assert len(long_ones) == 1, (name, client.special_texts)
        else:
            assert len(long_ones) >= 2, (name, client.special_texts)
    return compared


async def test_gemma_split_equals_full(gemma_template: RealServer, client_for: Any) -> None:
    compared = await compare(await client_for(gemma_template.url), expect_split=True)
    assert {"plain", "whitespace reply", "unicode", "multi-part", "tool calls"} <= set(compared)


async def test_tiny_chatml_split_equals_full(tiny_chatml: RealServer, client_for: Any) -> None:
    compared = await compare(await client_for(tiny_chatml.url), expect_split=True)
    assert {"plain", "whitespace reply", "unicode", "multi-part"} <= set(compared)


async def test_markers_that_are_plain_text_take_the_full_path(
    real_server: RealServer, client_for: Any
) -> None:
    # Gemma's vocabulary has no <|im_start|> token: the server reads it as text, check 1
    # fails, and every render is tokenised in full.
    compared = await compare(await client_for(real_server.url), expect_split=False)
    assert "plain" in compared


async def test_tokenize_all_equals_each_on_crafted_texts(
    gemma_template: RealServer, client_for: Any
) -> None:
    # Texts that share a head ending in every shape the boundary rule must handle: a marker
    # followed by whitespace, a tag the vocabulary lacks, a marker inside unicode.
    client = await client_for(gemma_template.url)
    head = "<start_of_turn>user\n" + UNICODE * 20 + "<end_of_turn>\n<start_of_turn>model\n"
    cases: Sequence[list[str]] = [
        [head + "<b>x</b> " + "y" * 60 + tail for tail in ("A", "Zebra, 42?")],
        [head + "<start_of_turn> spaced" + "z" * 60 + t for t in ("\n", " ", "")],
        [head + "東京<start_of_turn>京都" + "w" * 60 + t for t in ("。", "!")],
        [head + "<end_of_turn><start_of_turn>" + "v" * 60 + t for t in ("1", "2")],
    ]
    for texts in cases:
        assert await tokensplit.tokenize_all(client, texts) == await tokensplit.tokenize_each(
            client, texts
        )


async def saves_of_a_growing_conversation(client: CountingClient) -> None:
    """Three saves of one conversation, each a turn longer, through one Heads: the same
    prefixes as the full path, and from the second save on no render is tokenised whole."""
    heads = tokensplit.Heads()
    messages: list[dict[str, Any]] = [{"role": "system", "content": LONG}]
    for turn in range(3):
        messages += [
            {"role": "user", "content": f"Question {turn}: {UNICODE}"},
            {"role": "assistant", "content": f"Answer {turn}. " * 30},
        ]
        full = await canonical.prefix_tokens(
            client, {}, messages, tokenize=tokensplit.tokenize_each
        )
        client.special_texts.clear()
        assert full is not None
        assert await canonical.prefix_tokens(client, {}, messages, heads=heads) == full, turn
        long_ones = [n for n in client.special_texts if n > 1000]
        assert len(long_ones) == (1 if turn == 0 else 0), (turn, client.special_texts)


async def test_gemma_later_saves_tokenise_only_new_turns(
    gemma_template: RealServer, client_for: Any
) -> None:
    await saves_of_a_growing_conversation(await client_for(gemma_template.url))


async def test_tiny_chatml_later_saves_tokenise_only_new_turns(
    tiny_chatml: RealServer, client_for: Any
) -> None:
    await saves_of_a_growing_conversation(await client_for(tiny_chatml.url))
