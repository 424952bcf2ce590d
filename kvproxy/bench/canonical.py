"""`canonical`: what a save's canonical-prefix step costs on the real server, by size, with
every render tokenised in full ("before") and with the shared head tokenised once
(tokensplit.py, "after").

Per template and size: a conversation (system prompt of about `size` tokens, a question, the
model's reply) is put in the server's only slot, then, `repeats` times: the slot is made to
hold the prompt and reply again (the same greedy request), the probe renders are made
(`/apply-template`), tokenised both ways (the two results must be identical), and the
canonical prefix is evaluated on the slot (`/completion`, n_predict 0), as a save does.

Two templates: the model's own (for the bundled Gemma 3 270M, whose GGUF has none, the
server's ChatML fallback, whose markers are plain text to Gemma: no safe boundary, so the
"after" path is the full one plus a probe), and Gemma-style turn markup
(GEMMA_TEMPLATE, `<start_of_turn>` being Gemma's control token), as an instruct model's own
template renders it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from .. import canonical, tokensplit
from ..llama import LlamaClient
from ..upstream import Upstream
from .arms import BenchEnv, DirectArm
from .client import Client
from .conversations import facts_for, first_turn
from .report import progress, table

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
        return -(-(max(self.sizes) + 512) // 256) * 256


@dataclass
class Row:
    template: str
    target: int
    tokens: int = 0  # the canonical prefix
    renders: int = 0  # distinct renders tokenised
    head_once: bool = False  # the shared head was tokenised once (else every render in full)
    render_ms: float = 0.0
    full_ms: float = 0.0  # tokenising every render in full
    split_ms: float = 0.0  # tokensplit.tokenize_all
    evaluate_ms: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def before_ms(self) -> float:
        return self.render_ms + self.full_ms + self.evaluate_ms

    @property
    def after_ms(self) -> float:
        return self.render_ms + self.split_ms + self.evaluate_ms


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
    messages = first_turn(size, facts_for(size))
    times: dict[str, list[float]] = {"render": [], "full": [], "split": [], "evaluate": []}
    for i in range(opts.repeats):
        reply = await client.chat(url, messages, opts.reply_tokens, id_slot=0)
        if not reply.ok:
            row.errors.append(reply.error or "chat failed")
            break
        conversation = [*messages, {"role": "assistant", "content": reply.content}]
        t0 = time.perf_counter()
        prompts = await canonical.renders(llama, {}, conversation)
        t1 = time.perf_counter()
        if prompts is None:
            row.errors.append("no renders")
            break
        # Alternate which path goes first: neither gains from the other's warm-up.
        order = [tokensplit.tokenize_each, tokensplit.tokenize_all]
        spent: dict[str, float] = {}
        results: dict[str, list[int]] = {}
        for path in order if i % 2 == 0 else order[::-1]:
            llama.special_texts.clear()
            started = time.perf_counter()
            results[path.__name__] = canonical.common_prefix(await path(llama, prompts))
            spent[path.__name__] = time.perf_counter() - started
            if path is tokensplit.tokenize_all:
                row.head_once = llama.long_ones() == 1
        full, split = results["tokenize_each"], results["tokenize_all"]
        if full != split:
            row.errors.append(f"head-once tokens differ ({len(full)} vs {len(split)})")
            break
        t2 = time.perf_counter()
        await llama.evaluate(0, full)
        t3 = time.perf_counter()
        row.tokens, row.renders = len(full), len(prompts)
        times["render"].append(t1 - t0)
        times["full"].append(spent["tokenize_each"])
        times["split"].append(spent["tokenize_all"])
        times["evaluate"].append(t3 - t2)
    if times["render"]:
        row.render_ms = statistics.median(times["render"]) * 1000
        row.full_ms = statistics.median(times["full"]) * 1000
        row.split_ms = statistics.median(times["split"]) * 1000
        row.evaluate_ms = statistics.median(times["evaluate"]) * 1000
    return row


def markdown(res: CanonicalResult) -> str:
    columns = [
        "template",
        "prefix tokens",
        "renders",
        "head once",
        "render ms",
        "tokenise before ms",
        "tokenise after ms",
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
            f"{r.evaluate_ms:.1f}",
            f"{r.before_ms:.1f}",
            f"{r.after_ms:.1f}",
        ]
        for r in res.rows
    ]
    text = table(columns, rows)
    errors = [f"- {r.template} {r.target}: {e}" for r in res.rows for e in r.errors]
    note = (
        f"\nMedians of {res.options.repeats} saves per row; tokenise before = every render "
        "in full, after = the shared head once (tokensplit.py); the two token lists are "
        "compared on every save."
    )
    return text + note + ("\n\nErrors:\n" + "\n".join(errors) if errors else "")
