"""A tool-calling loop through kvproxy, with the OpenAI Python SDK.

    pip install openai                   # once: the OpenAI Python SDK
    kvproxy serve --model default        # in another terminal
    python examples/openai_tools.py

Agents spend most of their time in loops like this one: every round resends the whole
conversation plus one tool result, which is where kvproxy saves the most prefill. Small models
often answer without calling the tool; the loop handles both and says what happened.
"""

from __future__ import annotations

import json
import os
from typing import Any

try:
    from openai import OpenAI
except ModuleNotFoundError:
    raise SystemExit("This example uses the OpenAI Python SDK: pip install openai") from None

# The tool list is part of every prompt. Send the same list, in the same order, every round:
# a different list is a different prompt from its first token, and nothing can be reused.
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def get_weather(city: str) -> dict[str, Any]:
    return {"city": city, "sky": "sunny", "celsius": 21}  # a stand-in for a real lookup


def run_tool(name: str, arguments: str) -> str:
    """Runs one tool call; errors go back to the model as the result, as agents do."""
    try:
        args = json.loads(arguments or "{}")
        if name != "get_weather":
            raise ValueError(f"no tool named {name!r}")
        return json.dumps(get_weather(**args))
    except (ValueError, TypeError) as exc:
        return json.dumps({"error": str(exc)})


def add_tool_round(messages: list[dict[str, Any]], message: Any) -> None:
    """Appends the assistant's tool calls and their results to the history."""
    # Echo the assistant message as received (same ids, same argument strings): kvproxy keys
    # the reply in that form, so the next round finds the conversation still in its slot.
    messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
    for call in message.tool_calls:
        result = run_tool(call.function.name, call.function.arguments)
        print(f"tool {call.function.name}({call.function.arguments}) -> {result}")
        messages.append({"role": "tool", "tool_call_id": call.id, "content": result})


def main(max_rounds: int = 4) -> None:
    client = OpenAI(
        base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8081/v1"),
        api_key=os.environ.get("OPENAI_API_KEY", "none"),
    )
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You answer with the help of tools."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ]
    for round_no in range(1, max_rounds + 1):
        raw = client.chat.completions.with_raw_response.create(
            model="local", messages=messages, tools=TOOLS, max_tokens=48
        )
        message = raw.parse().choices[0].message
        print(f"round {round_no}: X-KVProxy-Cache={raw.headers.get('x-kvproxy-cache')}")
        if not message.tool_calls:
            how = "after the tool results" if round_no > 1 else "without calling a tool"
            print(f"the model answered {how}: {(message.content or '').strip()!r}")
            return
        add_tool_round(messages, message)
    print(f"stopped after {max_rounds} rounds of tool calls")


if __name__ == "__main__":
    main()
