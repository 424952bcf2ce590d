"""Clients that rewrite their last turn (OpenClaw's moving context message, aider's stripped
reminder), against a real llama-server: after kvproxy has seen the habit once, every later
turn comes back from disk and prefills only its new messages, also on a recurrent model and a
sliding-window one, which reuse a restored state only when the request extends it (or parts
from it near its end)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from .conftest import start_proxy, start_real_server
from .test_real_classes import HANDFUL, chat, first_messages, model_for, n_tokens

pytestmark = pytest.mark.real

CONTEXT = "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nchannel: cli, turn {t}\n<<<END_CONTEXT>>>"
REMINDER = "\n\nTo suggest changes to a file you MUST return the entire content of the file."


def openclaw(t: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(what the request adds, what stays in the history after it). The context message as
    OpenClaw 2026.9.6 sends it: a list of text parts."""
    ask = {"role": "user", "content": f"Tell me fact {t}."}
    context = {"role": "user", "content": [{"type": "text", "text": CONTEXT.format(t=t)}]}
    return [ask, context], [ask]


def aider(t: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ask = f"Change line {t}."
    return [{"role": "user", "content": ask + REMINDER}], [{"role": "user", "content": ask}]


async def crowd_out(url: str, t: int) -> None:
    """Three other conversations at once take both slots, so the agent's state goes to disk."""
    await asyncio.gather(*(chat(url, first_messages(100 * t + other)) for other in (1, 2, 3)))


@pytest.mark.parametrize("client", ["openclaw", "aider"])
@pytest.mark.parametrize("kind", ["recurrent", "swa"])
async def test_later_turns_of_a_rewriting_client_extend_the_saved_state(
    kind: str, client: str, tiny_models: dict[str, Path], cache_dir: Path
) -> None:
    shape = openclaw if client == "openclaw" else aider
    model, extra = model_for(kind, tiny_models)
    server = start_real_server(cache_dir, model, slots=2, ctx_per_slot=4096, extra=extra)
    proxy = await start_proxy(server.url, cache_dir)
    try:
        system = first_messages(1)[:1]
        new, kept = shape(1)
        reply, _ = await chat(proxy.url, [*system, *new])
        history = [
            *system,
            *kept,
            {"role": "assistant", "content": reply["choices"][0]["message"]["content"].strip()},
        ]
        seen = []
        for t in (2, 3, 4):
            await crowd_out(proxy.url, t)
            new, kept = shape(t)
            request = [*history, *new]
            reply, headers = await chat(proxy.url, request)
            fresh = await n_tokens(server.url, request, True) - await n_tokens(
                server.url, history, False
            )
            seen.append((t, headers["X-KVProxy-Cache"], reply["timings"], fresh))
            content = reply["choices"][0]["message"]["content"].strip()
            history = [*history, *kept, {"role": "assistant", "content": content}]
        # Turn 2 shows the habit; from turn 3 on, the saved state is what the client sends.
        for _t, decision, timings, fresh in seen[1:]:
            assert decision == "restored", seen
            assert timings["prompt_n"] <= fresh + HANDFUL, seen
    finally:
        await proxy.stop()
        server.stop()
