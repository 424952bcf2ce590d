"""The fake model behind the fake llama-server: one token per byte, a Gemma-like chat
template, the chat output parser (reasoning, tool calls) and the server's error JSON."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BOS = 2
EOS = 1
BYTE_OFFSET = 10
N_VOCAB = BYTE_OFFSET + 256

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
REASONING_TEXT = "Let me think."
TOOL_TRIGGER = "CALL_TOOL"
TOOL_ARGUMENTS = {"x": 1}
_TOOL_HEAD = re.compile(r'\s*\{"name": "([^"]+)", "arguments": ')

ERROR_CODES = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "not_found_error": 404,
    "server_error": 500,
    "permission_error": 403,
    "not_supported_error": 501,
    "unavailable_error": 503,
    "exceed_context_size_error": 400,
}

Json = dict[str, Any]


class RequestError(Exception):
    """A request that the real server answers with an error JSON."""

    def __init__(self, message: str, kind: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.kind = kind
        self.extra = extra


def error_json(message: str, kind: str, **extra: Any) -> Json:
    return {"error": {"code": ERROR_CODES[kind], "message": message, "type": kind, **extra}}


def error_response(message: str, kind: str = "invalid_request_error", **extra: Any) -> web.Response:
    return web.json_response(error_json(message, kind, **extra), status=ERROR_CODES[kind])


# --------------------------------------------------------------------------- tokenizer


def tokenize(text: str, add_special: bool = False) -> list[int]:
    """One token per UTF-8 byte (id = byte + 10); BOS (2) first when add_special."""
    return ([BOS] if add_special else []) + [b + BYTE_OFFSET for b in text.encode()]


def token_bytes(tokens: list[int]) -> bytes:
    out = bytearray()
    for tok in tokens:
        if tok >= BYTE_OFFSET:
            out.append(tok - BYTE_OFFSET)
        elif tok == BOS:
            out += b"<bos>"
        elif tok == EOS:
            out += b"<eos>"
    return bytes(out)


def detokenize(tokens: list[int]) -> str:
    return token_bytes(tokens).decode(errors="replace")


def tokenize_mixed(content: Any, add_special: bool) -> list[int]:
    """Like the server's tokenize_mixed: a string, or a list of strings and token ids."""
    if isinstance(content, str):
        return tokenize(content, add_special)
    if not isinstance(content, list):
        raise RequestError('"prompt" must be a string or an array of tokens')
    out: list[int] = []
    for i, item in enumerate(content):
        if isinstance(item, str):
            out += tokenize(item, add_special and i == 0)
        elif isinstance(item, int) and not isinstance(item, bool):
            out.append(item)
        else:
            raise RequestError("invalid prompt element")
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


# --------------------------------------------------------------------------- template


def content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"
        ]
        return "\n".join(parts)
    raise RequestError("Expected 'content' to be a string or an array")


def render_chat(messages: list[Json], add_generation_prompt: bool = True) -> str:
    """Gemma-like template; a trailing assistant message is continued (assistant prefill)."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise RequestError("'messages' must be an array of objects")
    prefill = bool(messages) and messages[-1].get("role") == "assistant"
    if prefill:
        if len(messages) >= 2 and messages[-2].get("role") == "assistant":
            raise RequestError("Cannot have 2 or more assistant messages at the end of the list.")
        if messages[-1].get("tool_calls"):
            raise RequestError("Cannot continue an assistant message that contains tool calls.")
        add_generation_prompt = False
    out: list[str] = []
    for i, msg in enumerate(messages):
        role = msg.get("role", "user")
        role = "model" if role == "assistant" else role
        text = content_text(msg.get("content"))
        for call in msg.get("tool_calls") or []:
            # Like templates that print the arguments string as the client sent it.
            fn = call.get("function") or {}
            text += f"<tool_call>{fn.get('name')} {fn.get('arguments')}</tool_call>"
        end = "" if prefill and i == len(messages) - 1 else "<end_of_turn>\n"
        out.append(f"<start_of_turn>{role}\n{text}{end}")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def default_reply(messages: list[Json]) -> str:
    users = [m for m in messages if m.get("role") == "user"]
    text = content_text(users[-1].get("content")) if users else ""
    return "Echo: " + text[:40]


# --------------------------------------------------------------------------- output parsing


@dataclass
class Msg:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[tuple[str, str, str]] = field(default_factory=list)  # (id, name, arguments)


def _strip_partial_tag(text: str, tag: str) -> str:
    for i in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:i]):
            return text[:-i]
    return text


def _json_value_prefix(text: str) -> str:
    """The first JSON value of text if it is complete, else all of text."""
    depth, in_str, esc = 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return text[: i + 1]
    return text


def parse_output(
    raw: str, partial: bool, thinking: bool, tools: bool, call_id: Callable[[int], str]
) -> Msg:
    """Split raw generated text into reasoning, content and tool calls like the chat parser."""
    msg = Msg()
    body = raw
    if thinking:
        if body.startswith(THINK_OPEN):
            rest = body[len(THINK_OPEN) :]
            if THINK_CLOSE in rest:
                msg.reasoning, body = rest.split(THINK_CLOSE, 1)
            else:
                msg.reasoning = _strip_partial_tag(rest, THINK_CLOSE) if partial else rest
                body = ""
        elif partial and THINK_OPEN.startswith(body):
            body = ""
    if tools and body.startswith(TOOL_OPEN):
        inner = body[len(TOOL_OPEN) :]
        head = _TOOL_HEAD.match(inner)
        if head:
            msg.tool_calls.append(
                (call_id(0), head.group(1), _json_value_prefix(inner[head.end() :]))
            )
        return msg
    if tools and partial and TOOL_OPEN.startswith(body):
        return msg
    msg.content = body
    return msg


def diff_msgs(prev: Msg, new: Msg) -> list[Json]:
    """OpenAI deltas between two parsed messages (common_chat_msg_diff::compute_diffs)."""
    deltas: list[Json] = []
    if new.reasoning != prev.reasoning:
        deltas.append({"reasoning_content": new.reasoning[len(prev.reasoning) :]})
    if new.content != prev.content:
        deltas.append({"content": new.content[len(prev.content) :]})
    for idx, (cid, name, args) in enumerate(new.tool_calls):
        call: Json = {"index": idx}
        if idx < len(prev.tool_calls):
            pid, pname, pargs = prev.tool_calls[idx]
            if (pid, pname) != (cid, name):
                call.update(id=cid, type="function")
            if args == pargs and (pid, pname) == (cid, name):
                continue
            fn: Json = {"name": name} if (pid, pname) != (cid, name) else {}
            if args[len(pargs) :]:
                fn["arguments"] = args[len(pargs) :]
        else:
            call.update(id=cid, type="function")
            fn = {"name": name}
            if args:
                fn["arguments"] = args
        if fn:
            call["function"] = fn
        deltas.append({"tool_calls": [call]})
    return deltas


def message_json(msg: Msg) -> Json:
    out: Json = {"role": "assistant", "content": msg.content}
    if msg.reasoning:
        out["reasoning_content"] = msg.reasoning
    if msg.tool_calls:
        out["tool_calls"] = [
            {"type": "function", "function": {"name": name, "arguments": args}, "id": cid}
            for cid, name, args in msg.tool_calls
        ]
    return out
