"""Two turns of one conversation through kvproxy, with the OpenAI Python SDK.

    pip install openai                   # once: the OpenAI Python SDK
    kvproxy serve --model default        # in another terminal
    python examples/openai_chat.py

OPENAI_BASE_URL and OPENAI_API_KEY override the address and key, as for any OpenAI client.
"""

import os

try:
    from openai import OpenAI
except ModuleNotFoundError:
    raise SystemExit("This example uses the OpenAI Python SDK: pip install openai") from None

# kvproxy speaks the OpenAI API: only the base URL changes. The key reaches llama-server only
# if it runs with --api-key, but kvproxy keeps each key's conversations apart: keep it stable.
client = OpenAI(
    base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8081/v1"),
    api_key=os.environ.get("OPENAI_API_KEY", "none"),
)

# Every turn resends the whole history; kvproxy makes the repeated part free. Keep the
# system prompt byte-identical between turns (no clock in it) or nothing can be reused.
messages = [{"role": "system", "content": "You are a concise assistant."}]

for turn, question in enumerate(["Name three colours of the rainbow.", "And three more?"], 1):
    messages.append({"role": "user", "content": question})
    # with_raw_response gives the HTTP headers too: kvproxy reports what it did in them.
    raw = client.chat.completions.with_raw_response.create(
        model="local",  # llama-server serves one model and ignores the name
        messages=messages,
        max_tokens=32,
    )
    reply = raw.parse()
    answer = reply.choices[0].message.content or ""
    # Send the reply back as received: that is the form kvproxy recognises next turn.
    messages.append({"role": "assistant", "content": answer})

    print(f"user: {question}")
    print(f"assistant: {answer.strip()}")
    # llama-server adds `timings`: cache_n prompt tokens were reused, prompt_n computed.
    timings = getattr(reply, "timings", None) or {}
    print(
        f"turn {turn}: X-KVProxy-Cache={raw.headers.get('x-kvproxy-cache')} "
        f"reused={timings.get('cache_n', '?')} computed={timings.get('prompt_n', '?')}"
    )
