"""A completion run on a fake slot and the JSON each endpoint makes of it: stream chunks,
final replies, `timings` and `usage` as llama-server writes them."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from kvproxy_fake.model import (
    BYTE_OFFSET,
    EOS,
    Json,
    Msg,
    detokenize,
    diff_msgs,
    message_json,
    parse_output,
)

if TYPE_CHECKING:
    from kvproxy_fake.server import FakeSlot


@dataclass
class Job:
    prompt: list[int]
    generated: list[int]  # what the model would sample, ending with EOS
    n_predict: int
    id_slot: int
    cache_prompt: bool
    stream: bool
    params: Json


@dataclass
class Run:
    """One completion task on a slot."""

    slot: FakeSlot
    job: Job
    cache_n: int = 0
    sampled: list[int] = field(default_factory=list)
    t_prompt_ms: float = 0.0
    t_gen_ms: float = 0.0
    released: bool = False

    @property
    def stopped_by_eos(self) -> bool:
        return bool(self.sampled) and self.sampled[-1] == EOS

    @property
    def text_tokens(self) -> list[int]:
        return [t for t in self.sampled if t != EOS]

    def timings(self) -> Json:
        prompt_n = len(self.job.prompt) - self.cache_n
        predicted_n = len(self.sampled)
        p_ms, g_ms = max(self.t_prompt_ms, 1e-3), max(self.t_gen_ms, 1e-3)
        return {
            "cache_n": self.cache_n,
            "prompt_n": prompt_n,
            "prompt_ms": self.t_prompt_ms,
            "prompt_per_token_ms": p_ms / max(prompt_n, 1),
            "prompt_per_second": 1e3 * prompt_n / p_ms,
            "predicted_n": predicted_n,
            "predicted_ms": self.t_gen_ms,
            "predicted_per_token_ms": g_ms / max(predicted_n, 1),
            "predicted_per_second": 1e3 * predicted_n / g_ms,
        }

    def usage(self) -> Json:
        n_prompt, n_gen = len(self.job.prompt), len(self.sampled)
        return {
            "completion_tokens": n_gen,
            "prompt_tokens": n_prompt,
            "total_tokens": n_prompt + n_gen,
            "prompt_tokens_details": {"cached_tokens": self.cache_n},
        }


def sse(data: Any) -> bytes:
    # Compact JSON, as llama-server writes its events (and what lets a stream go at
    # benchmark speed: one event per token).
    return b"data: " + orjson.dumps(data) + b"\n\n"


# --------------------------------------------------------------------------- reply formats


class Format:
    """Turns a completion run into the JSON of one endpoint (stream chunks and final)."""

    done_marker = True  # OpenAI-compatible streams end with `data: [DONE]`

    def __init__(self, model: str, cmpl_id: str) -> None:
        self.model = model
        self.cmpl_id = cmpl_id
        self.created = int(time.time())
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._in_sequence = False  # the decoder holds the first bytes of a UTF-8 sequence
        self.text = ""

    def feed(self, tok: int) -> str | None:
        """New text of a sampled token; None while a UTF-8 sequence is incomplete."""
        if tok == EOS:
            return ""
        byte = tok - BYTE_OFFSET
        if byte < 0x80 and not self._in_sequence:
            piece = chr(byte)  # what the decoder returns, at a fraction of its cost
        else:
            piece = self._decoder.decode(bytes([byte]))
            self._in_sequence = bool(self._decoder.getstate()[0])
        if not piece:
            return None
        self.text += piece
        return piece

    def partial(self, run: Run, tok: int) -> list[Json]:
        raise NotImplementedError

    def stream_events(self, run: Run, tok: int) -> list[bytes]:
        """The SSE events of a sampled token: `partial`'s, serialized."""
        return [sse(event) for event in self.partial(run, tok)]

    def final_stream(self, run: Run) -> list[Json]:
        raise NotImplementedError

    def final(self, run: Run) -> Json:
        raise NotImplementedError

    def finish_reason(self, run: Run, tool_calls: bool = False) -> str:
        if not run.stopped_by_eos:
            return "length"
        return "tool_calls" if tool_calls else "stop"


class CompletionFormat(Format):
    """Native /completion replies (no [DONE] at the end of a stream)."""

    done_marker = False

    def partial(self, run: Run, tok: int) -> list[Json]:
        piece = self.feed(tok)
        if piece is None:
            return []
        return [
            {
                "index": 0,
                "content": piece,
                "tokens": [],
                "stop": False,
                "id_slot": run.slot.id,
                "tokens_predicted": len(run.sampled),
                "tokens_evaluated": len(run.job.prompt),
            }
        ]

    def final_stream(self, run: Run) -> list[Json]:
        return [self._final(run, "")]

    def final(self, run: Run) -> Json:
        return self._final(run, detokenize(run.text_tokens))

    def _final(self, run: Run, content: str) -> Json:
        return {
            "index": 0,
            "content": content,
            "tokens": [],
            "id_slot": run.slot.id,
            "stop": True,
            "model": self.model,
            "tokens_predicted": len(run.sampled),
            "tokens_evaluated": len(run.job.prompt),
            "generation_settings": run.job.params,
            "prompt": detokenize(run.job.prompt),
            "has_new_line": "\n" in content,
            "truncated": False,
            "stop_type": "eos" if run.stopped_by_eos else "limit",
            "stopping_word": "",
            "tokens_cached": len(run.job.prompt) + max(len(run.sampled) - 1, 0),
            "timings": run.timings(),
        }


class OaiCompletionFormat(Format):
    """/v1/completions replies (object text_completion)."""

    def _obj(self, text: str, finish_reason: str | None) -> Json:
        choice = {"text": text, "index": 0, "logprobs": None, "finish_reason": finish_reason}
        return {
            "choices": [choice],
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "fake",
            "object": "text_completion",
            "id": self.cmpl_id,
        }

    def partial(self, run: Run, tok: int) -> list[Json]:
        piece = self.feed(tok)
        return [] if piece is None else [self._obj(piece, None)]

    def final_stream(self, run: Run) -> list[Json]:
        out = self._obj("", self.finish_reason(run))
        return [{**out, "usage": run.usage(), "timings": run.timings()}]

    def final(self, run: Run) -> Json:
        out = self._obj(detokenize(run.text_tokens), self.finish_reason(run))
        return {**out, "usage": run.usage(), "timings": run.timings()}


class ChatFormat(Format):
    """/v1/chat/completions replies, with reasoning and tool-call parsing."""

    def __init__(
        self,
        model: str,
        cmpl_id: str,
        *,
        thinking: bool,
        tools: bool,
        call_id: Callable[[int], str],
        include_usage: bool,
    ) -> None:
        super().__init__(model, cmpl_id)
        self.thinking = thinking
        self.tools = tools
        self.call_id = call_id
        self.include_usage = include_usage
        self.prev = Msg()
        self._content_events: dict[str, bytes] = {}  # piece -> its event, for plain content

    def parse(self, partial: bool) -> Msg:
        return parse_output(self.text, partial, self.thinking, self.tools, self.call_id)

    def _chunk(self, delta: Json | None, finish_reason: str | None = None) -> Json:
        choices = (
            [] if delta is None else [{"finish_reason": finish_reason, "index": 0, "delta": delta}]
        )
        return {
            "choices": choices,
            "created": self.created,
            "id": self.cmpl_id,
            "model": self.model,
            "system_fingerprint": "fake",
            "object": "chat.completion.chunk",
        }

    def partial(self, run: Run, tok: int) -> list[Json]:
        if self.feed(tok) is None:
            return []
        deltas: list[Json] = []
        if len(run.sampled) == 1:
            deltas.append({"role": "assistant", "content": None})
        cur = self.parse(partial=True)
        deltas += diff_msgs(self.prev, cur)
        self.prev = cur
        return [self._chunk(d) for d in deltas]

    def stream_events(self, run: Run, tok: int) -> list[bytes]:
        """Same bytes as `partial`'s events. Past the first token of a reply that is plain
        content (no reasoning, no tool calls to parse), the parsed message is the text so far
        and its diff the new piece: that event is serialized once per piece. A stream then
        costs the fake little more than its writes, as llama-server's cost next to kvproxy's
        relay: the `overhead` benchmark's SSE rate measures the relay, not the fake."""
        if self.thinking or self.tools or len(run.sampled) == 1:
            return super().stream_events(run, tok)
        piece = self.feed(tok)
        if not piece:  # an incomplete UTF-8 sequence, or EOS: the content has not changed
            return []
        self.prev.content = self.text
        event = self._content_events.get(piece)
        if event is None:
            event = self._content_events[piece] = sse(self._chunk({"content": piece}))
        return [event]

    def final_stream(self, run: Run) -> list[Json]:
        msg = self.parse(partial=False)
        out = [self._chunk(d) for d in diff_msgs(self.prev, msg)]
        out.append(self._chunk({}, self.finish_reason(run, bool(msg.tool_calls))))
        if self.include_usage:
            out.append({**self._chunk(None), "usage": run.usage()})
        out[-1]["timings"] = run.timings()
        return out

    def final(self, run: Run) -> Json:
        self.text = detokenize(run.text_tokens)
        msg = self.parse(partial=False)
        choice = {
            "finish_reason": self.finish_reason(run, bool(msg.tool_calls)),
            "index": 0,
            "message": message_json(msg),
        }
        return {
            "choices": [choice],
            "created": self.created,
            "model": self.model,
            "system_fingerprint": "fake",
            "object": "chat.completion",
            "usage": run.usage(),
            "id": self.cmpl_id,
            "timings": run.timings(),
        }
