"""Replies that end in a tool call, from a real model on the real llama-server: the bundled
Gemma 3 270M, served with a chat template that describes tools and renders tool calls in
`<tool_call>` tags (Qwen 2.5's, tool-calls.jinja beside this file, as llama.cpp carries it in
its `models/templates/Qwen-Qwen2.5-7B-Instruct.jinja`), a conversation whose earlier turns called
the tool (the model follows their pattern), `tool_choice: required` (the server's grammar then
keeps the call well formed) and the call's closing tag as a stop word (one call a reply; the
server's finish reason is then `tool_calls`). The random-weight test models cannot call a
tool: a grammar leaves them free text before the call, where they wander.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The template, as llama.cpp carries it (a file of this package).
TEMPLATE = (Path(__file__).parent / "tool-calls.jinja").read_text()

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the project",
            "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
        },
    }
]
# What a request that may end in a tool call carries besides its messages.
TOOL_REQUEST: dict[str, Any] = {
    "tools": TOOLS,
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "stop": ["</tool_call>"],
}


def write_template(directory: Path) -> Path:
    """The template as a file, for llama-server's `--chat-template-file`."""
    path = Path(directory) / "tool-calls.jinja"
    path.write_text(TEMPLATE)
    return path


def agent(n: int, calls: int = 3, pad: int = 0) -> list[dict[str, Any]]:
    """Agent `n`'s conversation so far: `calls` turns that read a file each (the pattern the
    model follows), then a request to read another; `pad` words of project notes in its system
    prompt make it longer."""
    notes = " ".join(f"note{i % 97}" for i in range(pad))
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are file reading agent {n}. {notes}".strip()}
    ]
    for i in range(calls):
        messages += called(f"file{n}-{i}.txt", f"call_{n}_{i}", f"the text of file {i}")
    messages.append({"role": "user", "content": f"Read the file file{n}-{calls}.txt."})
    return messages


def called(name: str, call_id: str, result: str) -> list[dict[str, Any]]:
    """A user turn asking to read `name`, the assistant's call, the tool's result."""
    call = {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
    return [
        {"role": "user", "content": f"Read the file {name}."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def with_result(
    messages: list[dict[str, Any]], reply: dict[str, Any], result: str = "done"
) -> list[dict[str, Any]]:
    """The conversation after a reply that called the tool: the call as the client echoes it,
    then the tool's result (the next request of the loop)."""
    message = reply["choices"][0]["message"]
    calls = message["tool_calls"]
    echoed = {"role": "assistant", "content": message.get("content") or None, "tool_calls": calls}
    return [*messages, echoed, {"role": "tool", "tool_call_id": calls[0]["id"], "content": result}]


def add_call_deltas(calls: list[dict[str, Any]], deltas: list[dict[str, Any]]) -> None:
    """Adds a streamed event's `tool_calls` deltas to `calls`, as OpenAI's SDKs assemble them:
    a delta's `index` names its call; the first carries its id, type and name, and every one
    a piece of the arguments."""
    for delta in deltas:
        index = int(delta.get("index", 0))
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        call["id"] = delta.get("id") or call["id"]
        call["type"] = delta.get("type") or call["type"]
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""


def reply_of(content: str, calls: list[dict[str, Any]]) -> dict[str, Any]:
    """A streamed reply as `with_result` takes it (a non-streamed reply's body)."""
    return {"choices": [{"message": {"content": content or None, "tool_calls": calls}}]}
