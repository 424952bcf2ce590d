"""tokensplit on plain data and against a toy tokeniser built like llama.cpp's: special tokens
cut out first (longest first), each raw fragment then tokenised on its own in a way that
depends on where the fragment starts (two characters a token), BOS with add_special, and
optionally an SPM-style space before each fragment that starts the text or follows a special
token. The real tokenisers are compared in tests/test_real_tokensplit.py."""

from __future__ import annotations

import re

from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.canonical import tokensplit
from kvproxy.http.session import Upstream
from kvproxy.server.api import LlamaClient

BOS = 2
TURN = "<start_of_turn>"
END = "<end_of_turn>"


class ToyClient(LlamaClient):
    def __init__(
        self,
        specials: dict[str, int],
        space_prefix: bool = False,
        eos: int | None = None,
    ) -> None:
        super().__init__(Upstream("http://127.0.0.1:9"))  # never called
        self.specials = specials
        self.space_prefix = space_prefix
        self.eos = eos
        self.vocab: dict[str, int] = {}
        self.full: list[int] = []  # lengths of the texts tokenised with add_special
        self.probes = 0  # calls without parse_special: only check 1 makes them

    async def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        if add_special and text:
            self.full.append(len(text))
        self.probes += not parse_special
        out = [BOS] if add_special else []
        names = sorted(self.specials, key=len, reverse=True)
        if parse_special and names:
            pieces = re.split("(" + "|".join(map(re.escape, names)) + ")", text)
        else:
            pieces = [text]
        prev_special = True
        for i, piece in enumerate(pieces):
            if i % 2 == 1:
                out.append(self.specials[piece])
                prev_special = True
            elif piece:
                if self.space_prefix and prev_special:
                    piece = " " + piece
                for j in range(0, len(piece), 2):
                    out.append(self.vocab.setdefault(piece[j : j + 2], 100 + len(self.vocab)))
                prev_special = False
        if add_special and self.eos is not None:
            out.append(self.eos)
        return out


def gemma_like(turns: list[tuple[str, str]], nxt: str) -> str:
    text = "".join(f"{TURN}{role}\n{content}{END}\n" for role, content in turns)
    return text + f"{TURN}user\n{nxt}{END}\n"


HISTORY = [("user", "Hello there, " * 30), ("model", "General Kenobi. " * 20)]
RENDERS = [gemma_like(HISTORY, "A"), gemma_like(HISTORY, "Zebra, 42?")]


def test_common_start() -> None:
    assert tokensplit.common_start(["abcd", "abce", "abc"]) == 3
    assert tokensplit.common_start(["x", "y"]) == 0
    assert tokensplit.common_start(["same", "same"]) == 4


def test_candidates_end_after_a_tag_before_no_whitespace() -> None:
    found = tokensplit.candidates(RENDERS)
    assert found and all(b.marker == TURN for b in found)  # <end_of_turn> is followed by \n
    last = found[0]
    assert RENDERS[0][last.at :].startswith("user\nA")  # the next message's own turn
    assert last.before.endswith(TURN) and last.after == [
        "user\nA<end_of_turn>\n",
        "user\nZebra, 42?<end_of_turn>\n",
    ]
    assert [b.at for b in found] == sorted((b.at for b in found), reverse=True)
    assert tokensplit.candidates(["no tags at all", "no tags here"]) == []


def test_candidates_stop_at_the_probed_number_of_markers() -> None:
    texts = ["".join(f"<t{i}>x" for i in range(10)) + s for s in ("1", "2")]
    assert {b.marker for b in tokensplit.candidates(texts)} == {"<t9>", "<t8>", "<t7>", "<t6>"}


def test_split_head() -> None:
    assert tokensplit.split_head([BOS, 7, 8, 5], 5, [BOS]) == ([BOS, 7, 8, 5], [])
    assert tokensplit.split_head([BOS, 7, 5, 1], 5, [BOS, 1]) == ([BOS, 7, 5], [1])
    assert tokensplit.split_head([BOS, 7, 5], 5, [BOS, 5]) is None  # the marker is the EOS
    assert tokensplit.split_head([BOS, 7, 8], 5, [BOS]) is None  # does not end with it


async def test_head_once_equals_each() -> None:
    for options in ({}, {"space_prefix": True}, {"eos": 1}):
        client = ToyClient({TURN: 5, END: 6}, **options)
        expected = await tokensplit.tokenize_each(client, RENDERS)
        client.full.clear()
        assert await tokensplit.tokenize_all(client, RENDERS) == expected, options
        assert len([n for n in client.full if n > 100]) == 1, options  # the head alone


async def test_markers_that_are_text_take_the_full_path() -> None:
    client = ToyClient({})  # the template's tags are plain text to this vocabulary
    expected = await tokensplit.tokenize_each(client, RENDERS)
    client.full.clear()
    assert await tokensplit.tokenize_all(client, RENDERS) == expected
    # Both renders in full: without Heads the probes go first, and fail.
    assert len([n for n in client.full if n > 100]) == 2


async def test_a_longer_special_token_across_the_boundary_takes_the_full_path() -> None:
    # `<start_of_turn>user` is a token of its own: right after `<start_of_turn>` is no seam.
    client = ToyClient({TURN: 5, END: 6, TURN + "user": 9})
    expected = await tokensplit.tokenize_each(client, RENDERS)
    client.full.clear()
    assert await tokensplit.tokenize_all(client, RENDERS) == expected
    assert TURN + "user" in RENDERS[0]


async def test_heads_tokenise_only_the_new_turns() -> None:
    client = ToyClient({TURN: 5, END: 6})
    heads = tokensplit.Heads()
    assert await heads.tokenize_all(client, RENDERS) == await tokensplit.tokenize_each(
        client, RENDERS
    )
    longer = [*HISTORY, ("user", "A"), ("model", "Another reply. " * 5)]
    renders = [gemma_like(longer, "A"), gemma_like(longer, "Zebra, 42?")]
    expected = await tokensplit.tokenize_each(client, renders)
    client.full.clear()
    assert await heads.tokenize_all(client, renders) == expected
    assert [n for n in client.full if n > 100] == []  # the first save's head was reused


async def test_heads_of_another_tokeniser_are_not_reused() -> None:
    heads = tokensplit.Heads()
    await heads.tokenize_all(ToyClient({TURN: 5, END: 6}), RENDERS)
    other = ToyClient({TURN: 5, END: 6}, space_prefix=True)  # a model swapped under the URL
    longer = [*HISTORY, ("user", "A"), ("model", "More. " * 5)]
    renders = [gemma_like(longer, "A"), gemma_like(longer, "Zebra, 42?")]
    expected = await tokensplit.tokenize_each(other, renders)
    assert await heads.tokenize_all(other, renders) == expected


async def test_prefix_tokens_with_heads_equals_the_full_path() -> None:
    client = ToyClient({TURN: 5, END: 6})
    messages = [{"role": "user", "content": "Hi " * 50}, {"role": "assistant", "content": "Yo"}]

    async def render(body: object) -> str:
        assert isinstance(body, dict)
        turns = [(m["role"], m["content"]) for m in body["messages"]]
        return "".join(f"{TURN}{r}\n{c}{END}\n" for r, c in turns)

    client.apply_template = render  # type: ignore[method-assign]  # a test double on one instance
    full = await canonical.prefix_tokens(client, {}, messages, tokenize=tokensplit.tokenize_each)
    assert full is not None
    assert await canonical.prefix_tokens(client, {}, messages, heads=tokensplit.Heads()) == full


async def test_heads_remember_markers_that_are_text() -> None:
    client = ToyClient({})
    heads = tokensplit.Heads()
    expected = await tokensplit.tokenize_each(client, RENDERS)
    assert await heads.tokenize_all(client, RENDERS) == expected
    assert client.probes == 1 and heads.plain == {TURN}
    client.full.clear()  # now no probe, and no head asked for with one
    assert await heads.tokenize_all(client, RENDERS) == expected
    assert client.probes == 1  # not asked again: straight to the full path
    assert len([n for n in client.full if n > 100]) == 2
