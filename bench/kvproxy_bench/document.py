"""The markdown a run writes (`--out DIR` → `DIR/benchmarks.md`): how each number was taken,
the tables, and the targets of issue #5 with the verdicts."""

from __future__ import annotations

from typing import Any

from kvproxy_bench import agents, load, overhead, restore, targets, workload
from kvproxy_bench import canonical_cost as canonical
from kvproxy_bench.report import header_lines

INTRO = """\
# Benchmarks

Produced by `kvproxy bench` (issue #5): the same work, run side by side through three arms
that differ only in caching — llama-server alone with `--cache-ram 0`, llama-server alone with
its default RAM prompt cache (`--cache-ram` 8 GiB), and kvproxy in managed mode (llama-server
with `--cache-ram 0` behind it). Every arm is started by the benchmark itself, fresh, with the
same model, slots, context, threads, `--no-kv-unified` and (for sliding-window models such as
Gemma 3) `--swa-full`.

**Absolute times vary** with the machine and whatever else runs on it (this one has 2 cores);
**the ratios are the claim.** Token counts (served from cache, prefilled) do not depend on
timing and are exact.
"""

WORKLOAD_METHOD = """\
## workload: N conversations × T turns through S slots

Turn 1 in order (1, 2, 3, 4); turn 2 in the order 1, 2, 4, 3, so the first conversation to come
back is not the one that stayed in a slot. The agent-paced case sends the same orders as an
agent would: a seeded gap of 0.5–3 s before every request (a tool running; the gaps are not
part of any time shown) and, after turn 1, a short tool-result-like user turn. A further case
sends two conversations through two slots in the order 1, 2, 1, 2 (all resident). The
restart case repeats the first with every process of the arm stopped and started between the
turns (kvproxy: SIGTERM, which saves its slots, then a new proxy and a new llama-server;
direct arms: a new llama-server). System prompts are ~1,400 tokens; replies are greedy
(`temperature: 0`), non-streamed, `max_tokens: 16`.

- **presented**: prompt tokens of the turn (`cache_n + prompt_n` from the replies' `timings`);
- **from cache**: `timings.cache_n`; **prefilled**: `timings.prompt_n`;
- **ideal prefill**: only the new turn. The prompt is rendered by the server's
  `/apply-template` and counted by `/tokenize` (`add_special: true`, as the server tokenises
  prompts); what is reusable is its longest common token prefix with the same conversation
  ending in a different user message (the shorter of two), i.e. every earlier turn, the
  replies as the client echoes them, and the turn markup. Ideal prefill = presented −
  reusable;
- **% of ideal** = from cache / (presented − ideal prefill) = `cache_n` / reusable: the share
  of what a perfect cache could serve that was served. Slightly above 100% is possible when the
  server also reuses tokens of the new turn's markup;
- **time**: the sum of the turn's request times at the client (requests are sequential);
  **vs no cache**: the no-cache arm's time for the same turn divided by this arm's.
"""

RESTORE_METHOD = """\
## restore: time to first token for a returning conversation

For each size, a conversation is sent (turn 1), then comes back with a new question (turn 2).
Time to first token (TTFT) is the wall time of a non-streamed request with `max_tokens: 1`.

- **resident (direct)**: llama-server (`--cache-ram 0`, one slot) still holds the conversation
  in its slot: only the new question is prefilled. Median of 3 questions;
- **re-prefill**: the same turn 2 with `cache_prompt: false`: all of it is prefilled;
- **restored (kvproxy)**: through kvproxy (one slot), after another conversation took the slot
  (kvproxy saved the first one to disk) and after the state file was dropped from the page
  cache (`posix_fadvise(DONTNEED)`): kvproxy restores it from disk. Median of 3 questions, each
  after a fresh eviction and a fresh page-cache drop;
- **cold read / warm read**: reading the whole state file after `posix_fadvise(DONTNEED)`, then
  again from the page cache;
- **limit** = resident + cold read: nothing that has to read the state back from disk can
  answer faster; **restored / limit** is how close kvproxy gets.
"""

OVERHEAD_METHOD = """\
## overhead: kvproxy's own cost

The fake llama-server (`bench/kvproxy_fake/server.py`) answering at once, kvproxy
(`kvproxy serve --upstream`, default settings, log level info), and the benchmark client each
run as their own process. The client sends every request itself, one at a time, alternating
direct and proxied, so its own cost and the machine's drift fall on both paths: **added** =
proxied − direct at the same percentile. Two modes: **cache on** (the fake answers `/slots`:
every chat request is keyed and pinned to a slot; a turn that continues what its slot holds
goes without a check, and one `GET /slots` after each reply, once the slot is given back,
shows the server's picture of it: one extra round trip, off the reply's path) and
**pass-through** (`/slots` answers 501 as on a server without slots).

- small requests: a two-message non-streamed chat request, 8-token reply;
- SSE: one streamed reply of 20,000 events, one write per event (as llama-server sends one
  event per token), events per second at the client, median of 3;
- TTFB: time to the first body byte of a streamed reply, p50;
- keys: in-process, `orjson.loads` of a 1 MB, 500-message request body, the namespace, and the
  chained hash over every message (what kvproxy computes per chat request), median of 30.
"""

LOAD_METHOD = """\
## load: concurrent clients through few slots

16 clients share 32 conversations (~350-token system prompts, so every evicted conversation
is saved) through 4 slots, 3 turns each: 96 requests. A conversation's next turn is sent as
soon as its previous reply is back, by whichever client is free, so slots change hands all the
time (evictions, saves, restores under contention). **wait** = client latency − the server's
own time for the request (`prompt_ms + predicted_ms`): queueing for a slot, saves, restores,
relaying. With 16 clients on 4 slots, up to 12 requests wait for a slot at any time, so wait
is mostly queueing by design; what matters here is that nothing fails and nothing stalls. A
**stall** would be 180 s without any reply.
"""


def document(head: dict[str, Any], results: dict[str, Any], images: dict[str, str]) -> str:
    parts = [INTRO, "## This run\n\n" + "\n".join(header_lines(head))]
    checks: list[targets.Check] = []
    if "workload" in results:
        r = results["workload"]
        text = WORKLOAD_METHOD + "\n" + workload.markdown(r)
        if "workload" in images:
            text += f"\n\n![Later turns served from cache, per arm]({images['workload']})"
        parts.append(text)
        checks += targets.workload_checks(r)
    if "restore" in results:
        r = results["restore"]
        text = RESTORE_METHOD + "\n" + restore.markdown(r)
        if "restore" in images:
            text += f"\n\n![TTFT restored vs re-prefilled]({images['restore']})"
        parts.append(text)
        checks += targets.restore_checks(r)
    if "overhead" in results:
        r = results["overhead"]
        parts.append(OVERHEAD_METHOD + "\n" + overhead.markdown(r))
        checks += targets.overhead_checks(r)
    if "load" in results:
        r = results["load"]
        parts.append(LOAD_METHOD + "\n" + load.markdown(r))
        checks += targets.load_checks(r)
    if "canonical" in results:
        parts.append("## Canonical prefix\n\n" + canonical.markdown(results["canonical"]))
    if "big" in results:
        from kvproxy_bench import big, big_report

        text = f"## big: states of an 8B model's size\n\n{big.__doc__}\n" + big_report.markdown(
            results["big"]
        )
        if "big" in images:
            text += f"\n\n![Returning TTFT and restore throughput]({images['big']})"
        parts.append(text)
        checks += big_report.checks(results["big"])
    if "toolloop" in results:
        from kvproxy_bench import toolloop

        parts.append(
            f"## toolloop: a tool result while newcomers want the slots\n\n{toolloop.__doc__}\n"
            + toolloop.markdown(results["toolloop"])
        )
    if "agents" in results:
        parts.append(agents.METHOD + "\n" + agents.markdown(results["agents"]))
        checks += agents.checks(results["agents"])
    parts.append("## Targets (issue #5)\n\n" + targets.checks_markdown(checks))
    parts.append("## Summary\n\n" + targets.summary_table(results))
    return "\n\n".join(parts) + "\n"
