"""A streamed reply through kvproxy, with the OpenAI Python SDK.

    pip install openai                   # once: the OpenAI Python SDK
    kvproxy serve --model default        # in another terminal
    python examples/openai_stream.py

kvproxy relays each server-sent event as soon as llama-server sends it: streaming through
the proxy feels the same as streaming from the server.
"""

import os

try:
    from openai import OpenAI
except ModuleNotFoundError:
    raise SystemExit("This example uses the OpenAI Python SDK: pip install openai") from None

client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8081/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "none"),
)

raw = client.chat.completions.with_raw_response.create(
    model="local",  # llama-server serves one model and ignores the name
    messages=[
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Write one sentence about the sea."},
    ],
    max_tokens=32,
    stream=True,
    # Ask for token counts in the last event, as the OpenAI API does.
    stream_options={"include_usage": True},
)
# The headers come before the first token, so kvproxy's verdict is known up front.
print(f"X-KVProxy-Cache: {raw.headers.get('x-kvproxy-cache')}")

chunks, usage = 0, None
for chunk in raw.parse():
    if chunk.choices and chunk.choices[0].delta.content:
        chunks += 1
        print(chunk.choices[0].delta.content, end="", flush=True)
    usage = chunk.usage or usage
print()
print(f"[{chunks} content chunks", end="")
if usage:
    print(f"; {usage.prompt_tokens} prompt + {usage.completion_tokens} completion tokens", end="")
print("]")
