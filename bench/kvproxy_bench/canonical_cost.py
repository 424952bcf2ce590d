"""`canonical`: what a save's canonical-prefix step costs on the real server, by size: the
renders, their tokenisation three ways, and the evaluation on the slot.

Per template and size: one conversation (a system prompt of about `size` tokens) runs
`repeats + 1` turns in the server's only slot; after each reply the step a save makes runs
as kvproxy/cache/slotio/slotwork.py does it: the probe renders (`/apply-template`), tokenised (1)
every render in full, as before tokensplit.py ("all"), (2) the shared head once and the
tails apart, as a conversation's first save does ("head once"), (3) with the Heads the
previous saves left, as its later saves do ("with heads"); the three token lists must be
identical. Then the canonical prefix is evaluated on the slot (`/completion`, n_predict 0).
The first turn's save only fills the Heads: the medians are over the later ones.

Two templates: the model's own (for the bundled Gemma 3 270M, whose GGUF has none, the
server's ChatML fallback, whose markers are plain text to Gemma: there is no safe seam, so
every way is the full path, plus a probe), and Gemma-style turn markup (GEMMA_TEMPLATE;
`<start_of_turn>` is Gemma's control token), as an instruct model's own template renders.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy.cache.canonical import prefix as canonical
from kvproxy.cache.canonical import tokensplit
from kvproxy.http.session import Upstream
from kvproxy.server.api import LlamaClient
from kvproxy_bench.arms import BenchEnv, DirectArm
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import facts_for, first_turn, next_turn
from kvproxy_bench.report import progress, table

# Gemma 3's turn markup, with tool calls and multi-part content (the tests use it too).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{%- for m in messages -%}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{%- if m['content'] is string -%}{{ m['content'] | trim }}"
    "{%- elif m['content'] -%}{%- for p in m['content'] -%}{{ p['text'] }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- for c in m.get('tool_calls') or [] -%}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{%- endfor -%}"
    "<end_of_turn>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
)
OWN, GEMMA = "model's own", "Gemma markup"
LONG_TEXT = 1000  # characters: a tokenised text this long is a whole render or a head


@dataclass
class CanonicalOptions:
    sizes: tuple[int, ...] = (1024, 4096, 8192)
    repeats: int = 5
    reply_tokens: int = 24
    templates: tuple[str, ...] = (OWN, GEMMA)

    @property
    def ctx_per_slot(self) -> int:
        # The facts run ~15% over their estimate; the turns add a few hundred tokens.
        return -(-(int(max(self.sizes) * 1.2) + 1024) // 256) * 256


@dataclass
class Row:
    template: str
    target: int
    tokens: int = 0  # the canonical prefix
    renders: int = 0  # distinct renders tokenised
    head_once: bool = False  # the shared head was tokenised once (else every render in full)
    render_ms: float = 0.0
    full_ms: float = 0.0  # tokenising every render in full
    split_ms: float = 0.0  # tokensplit.tokenize_all: a conversation's first save
    heads_ms: float = 0.0  # the same with the Heads of its earlier saves: later saves
    evaluate_ms: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def before_ms(self) -> float:
        return self.render_ms + self.full_ms + self.evaluate_ms

    @property
    def after_ms(self) -> float:
        return self.render_ms + self.heads_ms + self.evaluate_ms


@dataclass
class CanonicalResult:
    options: CanonicalOptions
    rows: list[Row]

    def to_json(self) -> dict[str, Any]:
        return {
            "options": asdict(self.options),
            "rows": [
                {**asdict(r), "before_ms": r.before_ms, "after_ms": r.after_ms} for r in self.rows
            ],
        }


class CountingClient(LlamaClient):
    """Records the length of every text tokenised with add_special: whole renders or heads."""

    def __init__(self, upstream: Upstream) -> None:
        super().__init__(upstream)
        self.special_texts: list[int] = []

    async def tokenize(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        if add_special and text:
            self.special_texts.append(len(text))
        return await super().tokenize(text, add_special, parse_special)

    def long_ones(self) -> int:
        return sum(1 for n in self.special_texts if n > LONG_TEXT)


async def run_canonical(env: BenchEnv, opts: CanonicalOptions) -> CanonicalResult:
    rows: list[Row] = []
    for template in opts.templates:
        tenv = env
        if template == GEMMA:
            path = env.workdir / "gemma.jinja"
            await asyncio.to_thread(path.write_text, GEMMA_TEMPLATE, "utf-8")
            flags = [*env.server_args, "--chat-template-file", str(path)]
            tenv = dataclasses.replace(env, server_args=flags)
        arm = DirectArm(tenv, 1, opts.ctx_per_slot, ram_cache=False)
        progress(f"canonical: {template}: starting llama-server")
        async with arm:
            upstream = Upstream(arm.url)
            await upstream.start()
            client = Client()
            try:
                for size in opts.sizes:
                    progress(f"canonical: {template}, {size} tokens")
                    rows.append(await _measure(arm.url, client, upstream, template, size, opts))
            finally:
                await client.close()
                await upstream.close()
    return CanonicalResult(opts, rows)


async def _measure(
    url: str, client: Client, upstream: Upstream, template: str, size: int, opts: CanonicalOptions
) -> Row:
    row = Row(template, size)
    llama = CountingClient(upstream)
    heads = tokensplit.Heads()  # carried from save to save, as slotio's is
    messages = first_turn(size, facts_for(size))
    times: dict[str, list[float]] = {k: [] for k in ("render", "full", "once", "heads", "eval")}
    for turn in range(opts.repeats + 1):
        reply = await client.chat(url, messages, opts.reply_tokens, id_slot=0)
        if not reply.ok:
            row.errors.append(reply.error or "chat failed")
            break
        conversation = [*messages, {"role": "assistant", "content": reply.content}]
        messages = next_turn(messages, reply.content, turn + 2)
        t0 = time.perf_counter()
        prompts = await canonical.renders(llama, {}, conversation)
        t1 = time.perf_counter()
        if prompts is None:
            row.errors.append("no renders")
            break
        ways: dict[str, Any] = {
            "full": tokensplit.tokenize_each,
            "once": tokensplit.tokenize_all,
            "heads": heads.tokenize_all,
        }
        names = list(ways)
        # Rotate which way goes first: none gains from another's warm-up.
        names = names[turn % 3 :] + names[: turn % 3]
        spent: dict[str, float] = {}
        results: dict[str, list[int]] = {}
        for name in names:
            llama.special_texts.clear()
            started = time.perf_counter()
            results[name] = canonical.common_prefix(await ways[name](llama, prompts))
            spent[name] = time.perf_counter() - started
            if name == "once":
                row.head_once = llama.long_ones() == 1
        if not results["full"] == results["once"] == results["heads"]:
            row.errors.append(f"turn {turn}: the ways' tokens differ")
            break
        t2 = time.perf_counter()
        await llama.evaluate(0, results["full"])
        t3 = time.perf_counter()
        row.tokens, row.renders = len(results["full"]), len(prompts)
        if turn == 0:
            continue  # the heads are empty at a conversation's first save: that is "once"
        times["render"].append(t1 - t0)
        times["eval"].append(t3 - t2)
        for name in ways:
            times[name].append(spent[name])
    if times["render"]:
        med = {k: statistics.median(v) * 1000 for k, v in times.items()}
        row.render_ms, row.evaluate_ms = med["render"], med["eval"]
        row.full_ms, row.split_ms, row.heads_ms = med["full"], med["once"], med["heads"]
    return row


def markdown(res: CanonicalResult) -> str:
    columns = [
        "template",
        "prefix tokens",
        "renders",
        "head once",
        "render ms",
        "tokenise: all ms",
        "head once ms",
        "with heads ms",
        "evaluate ms",
        "step before ms",
        "step after ms",
    ]
    rows = [
        [
            r.template,
            r.tokens,
            r.renders,
            "yes" if r.head_once else "no (full path)",
            f"{r.render_ms:.1f}",
            f"{r.full_ms:.1f}",
            f"{r.split_ms:.1f}",
            f"{r.heads_ms:.1f}",
            f"{r.evaluate_ms:.1f}",
            f"{r.before_ms:.1f}",
            f"{r.after_ms:.1f}",
        ]
        for r in res.rows
    ]
    text = table(columns, rows)
    errors = [f"- {r.template} {r.target}: {e}" for r in res.rows for e in r.errors]
    note = (
        f"\nMedians of the saves after turns 2..{res.options.repeats + 1} of one conversation "
        "(a turn each). Tokenise: all = every render in full (before); head once = the shared "
        "head once and the tails apart (a conversation's first save); with heads = only the "
        "text after the head the previous save tokenised (later saves). The three token lists "
        "are compared on every save. Step before = render + all + evaluate; step after = "
        "render + with heads + evaluate."
    )
    return text + note + ("\n\nErrors:\n" + "\n".join(errors) if errors else "")
