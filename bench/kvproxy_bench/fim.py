"""A deterministic llama.vscode editing session: the request bodies the extension would send.

Read from ggml-org/llama.vscode v0.0.63 (commit 3938fb3):

- `src/llama-server.ts`, `createRequestPayload(noPredict, …)`: the `/infill` body. A
  completion is `{id_slot: 0, input_prefix, input_suffix, input_extra: chunks, prompt,
  n_predict, n_cmpl: max_parallel_completions, top_k: 40, top_p: 0.99, stream: false,
  samplers: ["top_k", "top_p", "infill"], cache_prompt: true, n_indent (when > 0),
  t_max_prompt_ms, t_max_predict_ms}`; a ring update (`noPredict`) is `{id_slot: 0,
  input_prefix: "", input_suffix: "", input_extra: chunks, prompt: "", n_predict: 0,
  samplers: [], cache_prompt: true, t_max_prompt_ms, t_max_predict_ms: 1}`.
- `getFIMCompletion` posts the first to `/infill`; `updateExtraContext` posts the second,
  and only in llama.cpp mode (with `use_openai_endpoint` it returns at once).
- `handleOpenAICompletion`: with `use_openai_endpoint` the OpenAI SDK's
  `client.completions.create({model, prompt: "Context:\\n\\n" + chunk texts joined by "\\n"
  (when any) + openai_prompt_template filled in, max_tokens: n_predict, temperature: 0.1,
  top_p: 0.99, stream: false})`; the template's default (`src/configuration.ts`) is
  `<|fim_prefix|>{inputPrefix}{prompt}<|fim_suffix|>{inputSuffix}<|fim_middle|>`, with
  inputPrefix cut to its last n_prefix characters and inputSuffix to its first n_suffix.
- `src/completion.ts`, `provideInlineCompletionItems`: input_prefix is the n_prefix (256)
  lines above the cursor each followed by "\\n"; input_suffix is the rest of the cursor's line,
  "\\n", and the n_suffix (64) lines below, each followed by "\\n"; prompt is the cursor line
  up to the cursor ("" when only blanks); n_indent is the line's leading whitespace.
- `src/extra-context.ts`: `addFimContextChunks` (after a completion, when the cursor moved
  more than MAX_LAST_PICK_LINE_DISTANCE = 32 lines since the last pick) queues a chunk from
  the lines ring_scope (1024) .. n_prefix above the cursor and one from the ring_chunk_size
  (64) lines after n_suffix below; `handleDocumentSave` of another file queues a chunk of
  that file; `pickChunk` skips chunks under 3 lines and takes a random ring_chunk_size/2
  lines of longer ones, text = lines joined by "\\n" + "\\n", `{text, time, filename}`.
  `periodicRingBufferUpdate` (every ring_update_ms = 1000 ms, `src/architect.ts`) moves
  one queued chunk into the ring (at most ring_n_chunks = 16, oldest dropped) and sends the
  n_predict 0 request, when a chunk is queued and the last completion started ≥
  RING_UPDATE_MIN_TIME_LAST_COMPL = 3000 ms ago.

The session: one file edited line by line (a few keystrokes per line, each a completion),
cursor jumps that queue chunks, saves of other files, and idle pauses in which the ring
updates. `random.Random(seed)` makes every choice: the same seed gives the same requests.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Literal

Json = dict[str, Any]
FIM_TEMPLATE = "<|fim_prefix|>{inputPrefix}{prompt}<|fim_suffix|>{inputSuffix}<|fim_middle|>"
MAX_LAST_PICK_LINE_DISTANCE = 32
MAX_QUEUED_CHUNKS = 16

_NAMES = ("cache", "slot", "entry", "conversation", "prefix", "token", "budget", "store")
_VERBS = ("load", "save", "restore", "evict", "count", "match", "render", "check")


@dataclass(frozen=True)
class FimConfig:
    """llama.vscode's settings (defaults of `src/configuration.ts`); n_predict is lower
    in the benchmark (a CPU run), the other fields are the extension's."""

    n_prefix: int = 256
    n_suffix: int = 64
    n_predict: int = 128
    t_max_prompt_ms: int = 500
    t_max_predict_ms: int = 2500
    ring_n_chunks: int = 16
    ring_chunk_size: int = 64
    ring_scope: int = 1024
    max_parallel_completions: int = 3


@dataclass
class FimRequest:
    """One request of the session: `infill` (a completion), or `ring` (n_predict 0)."""

    kind: Literal["infill", "ring"]
    body: Json  # the /infill body (llama.cpp mode)
    openai: Json | None  # completions.create's arguments (OpenAI mode; None for a ring update)
    note: str


def code_file(rng: random.Random, name: str, n_lines: int) -> list[str]:
    """Python-like lines: functions of a few indented statements."""
    lines: list[str] = [f"# {name}", ""]
    while len(lines) < n_lines:
        verb, noun = rng.choice(_VERBS), rng.choice(_NAMES)
        lines.append(f"def {verb}_{noun}_{len(lines)}({noun}, limit={rng.randint(1, 99)}):")
        for _ in range(rng.randint(2, 5)):
            other = rng.choice(_NAMES)
            lines.append(f"    {other} = {rng.choice(_VERBS)}({noun}, {other}_{rng.randint(0, 9)})")
        lines.append(f"    return {noun}")
        lines.append("")
    return lines[:n_lines]


def infill_body(
    prefix: str, suffix: str, chunks: list[Json], prompt: str, n_indent: int, cfg: FimConfig
) -> Json:
    """`createRequestPayload(false, …)` (no lora, no model: the extension's defaults)."""
    body: Json = {
        "id_slot": 0,
        "input_prefix": prefix,
        "input_suffix": suffix,
        "input_extra": [dict(c) for c in chunks],
        "prompt": prompt,
        "n_predict": cfg.n_predict,
        "n_cmpl": cfg.max_parallel_completions,
        "top_k": 40,
        "top_p": 0.99,
        "stream": False,
        "samplers": ["top_k", "top_p", "infill"],
        "cache_prompt": True,
    }
    if n_indent:
        body["n_indent"] = n_indent
    body["t_max_prompt_ms"] = cfg.t_max_prompt_ms
    body["t_max_predict_ms"] = cfg.t_max_predict_ms
    return body


def ring_body(chunks: list[Json], cfg: FimConfig) -> Json:
    """`createRequestPayload(true, "", "", chunks, "", …)`: warms the slot with the ring."""
    return {
        "id_slot": 0,
        "input_prefix": "",
        "input_suffix": "",
        "input_extra": [dict(c) for c in chunks],
        "prompt": "",
        "n_predict": 0,
        "samplers": [],
        "cache_prompt": True,
        "t_max_prompt_ms": cfg.t_max_prompt_ms,
        "t_max_predict_ms": 1,
    }


def openai_args(prefix: str, suffix: str, chunks: list[Json], prompt: str, cfg: FimConfig) -> Json:
    """`handleOpenAICompletion`'s `client.completions.create` arguments."""
    context = "Context:\n\n" + "\n".join(c["text"] for c in chunks) if chunks else ""
    filled = (
        FIM_TEMPLATE.replace("{inputPrefix}", prefix[-cfg.n_prefix :])
        .replace("{prompt}", prompt)
        .replace("{inputSuffix}", suffix[: cfg.n_suffix])
    )
    return {
        "model": "",
        "prompt": context + filled,
        "max_tokens": cfg.n_predict,
        "temperature": 0.1,
        "top_p": 0.99,
        "stream": False,
    }


@dataclass
class _Ring:
    """`ExtraContext`'s ring and queue (`src/extra-context.ts`)."""

    cfg: FimConfig
    rng: random.Random
    chunks: list[Json] = field(default_factory=list)
    queued: list[Json] = field(default_factory=list)
    clock_ms: int = 0

    def pick(self, lines: list[str], filename: str, evict: bool) -> None:
        if self.cfg.ring_n_chunks <= 0 or len(lines) < 3:
            return
        half = self.cfg.ring_chunk_size // 2
        if len(lines) + 1 < self.cfg.ring_chunk_size:
            taken = lines
        else:
            start = self.rng.randrange(max(0, len(lines) - half + 1) or 1)
            taken = lines[start : min(start + half, len(lines))]
        text = "\n".join(taken) + "\n"
        if evict and any(c["text"] == text for c in self.chunks + self.queued):
            return
        if evict:  # Jaccard similarity of line sets > 0.9 evicts, from the ring and the queue
            self.chunks = [c for c in self.chunks if _jaccard(c["text"], text) <= 0.9]
            self.queued = [c for c in self.queued if _jaccard(c["text"], text) <= 0.9]
        if len(self.queued) >= MAX_QUEUED_CHUNKS:
            self.queued.pop(0)
        self.queued.append({"text": text, "time": self.clock_ms, "filename": filename})

    def update(self) -> bool:
        """`periodicRingBufferUpdate`: True when it sends the n_predict 0 request."""
        if not self.queued:
            return False
        self.chunks.append(self.queued.pop(0))
        while len(self.chunks) > self.cfg.ring_n_chunks:
            self.chunks.pop(0)
        return True


def _jaccard(a: str, b: str) -> float:
    sa, sb = set(a.split("\n")[:-1]), set(b.split("\n")[:-1])
    union = sa | sb
    return len(sa & sb) / len(union) if union else 1.0


def _context(doc: list[str], line: int, col: int, cfg: FimConfig) -> tuple[str, str, str, int]:
    """`provideInlineCompletionItems`' inputPrefix, inputSuffix, prompt and nindent."""
    start = max(0, line - cfg.n_prefix)
    end = min(len(doc) - 1, line + cfg.n_suffix)
    text = doc[line]
    prompt = text[:col]
    if prompt.strip(" \t") == "":
        prompt = ""
    prefix = "".join(ln + "\n" for ln in doc[start:line])
    suffix = text[col:] + "\n" + "".join(ln + "\n" for ln in doc[line + 1 : end + 1])
    return prefix, suffix, prompt, len(text) - len(text.lstrip())


def editing_session(
    seed: int = 35,
    edits: int = 24,
    cfg: FimConfig | None = None,
    file_lines: int = 400,
    keystrokes_per_line: int = 3,
) -> list[FimRequest]:
    """`edits` new lines typed into one file (each in `keystrokes_per_line` completions),
    with a cursor jump every 6 edits, a save of another file every 4, and an idle pause
    (the ring updates, one queued chunk each) after every 3."""
    cfg = cfg or FimConfig()
    rng = random.Random(seed)
    doc = code_file(rng, "src/editor.py", file_lines)
    others = {f"src/{n}.py": code_file(rng, f"src/{n}.py", 120) for n in ("store", "slots", "keys")}
    ring = _Ring(cfg, rng)
    requests: list[FimRequest] = []
    line, last_pick = file_lines // 2, -9999
    for edit in range(edits):
        if edit and edit % 6 == 0:  # a jump: somewhere else in the file
            line = rng.randrange(40, len(doc) - 40)
        new_line = "    " + code_file(rng, "typed", 4)[2].strip()
        doc.insert(line, "")
        cuts = sorted(
            {len(new_line) * (k + 1) // keystrokes_per_line for k in range(keystrokes_per_line)}
        )
        for col in cuts:
            doc[line] = new_line[:col]
            prefix, suffix, prompt, nindent = _context(doc, line, col, cfg)
            ring.clock_ms += 400
            requests.append(
                FimRequest(
                    "infill",
                    infill_body(prefix, suffix, ring.chunks, prompt, nindent, cfg),
                    openai_args(prefix, suffix, ring.chunks, prompt, cfg),
                    f"edit {edit + 1} line {line} col {col}",
                )
            )
            if abs(line - last_pick) > MAX_LAST_PICK_LINE_DISTANCE:  # addFimContextChunks
                above = doc[max(0, line - cfg.ring_scope) : max(0, line - cfg.n_prefix) + 1]
                ring.pick(above, "src/editor.py", evict=False)
                lo = min(len(doc) - 1, line + cfg.n_suffix)
                hi = min(len(doc) - 1, line + cfg.n_suffix + cfg.ring_chunk_size)
                ring.pick(doc[lo : hi + 1], "src/editor.py", evict=False)
                last_pick = line
        line += 1
        if edit % 4 == 3:  # another file saved: handleDocumentSave picks from it
            name = rng.choice(sorted(others))
            ring.pick(others[name], name, evict=True)
        if edit % 3 == 2:  # idle: one ring update a second, from 3 s after the last completion
            ring.clock_ms += 3000
            for _ in range(2):
                ring.clock_ms += 1000
                if ring.update():
                    requests.append(
                        FimRequest(
                            "ring", ring_body(ring.chunks, cfg), None, f"ring after {edit + 1}"
                        )
                    )
    return requests
