"""What `kvproxy bench agents` records of a turn, whatever plan or case drove it: each request
the tap saw, as a row (the server's numbers, kvproxy's decision) beside its ideal, the longest
common token prefix of its rendered prompt with anything an earlier request of the same client
left (see agents.py)."""

from __future__ import annotations

import asyncio
from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy.keys import shared_prefix
from kvproxy_bench.agentdrivers import LABELS
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import first_turn
from kvproxy_bench.exchanges import Record, read
from kvproxy_bench.report import progress
from kvproxy_bench.tap import Tap


@dataclass
class Row:
    client: str
    arm: str
    turn: str
    request: int  # 1, 2, … within the turn
    decision: str
    cache_n: int
    prompt_n: int
    ideal: int | None  # None: nothing earlier to reuse (the first request)
    error: str | None = None
    evaluated: int = 0  # X-KVProxy-Evaluated-Tokens: in cache_n, prefilled meanwhile

    @property
    def presented(self) -> int:
        return self.cache_n + self.prompt_n


@dataclass
class AgentsResult:
    options: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # client → why it did not run
    failures: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def record_turn(
    client: Client,
    url: str,
    tap: Tap,
    name: str,
    arm: str,
    label: str,
    history: list[list[int]],
    result: AgentsResult,
) -> None:
    """The requests client `name` made in its turn `label` (what the tap took since the
    last turn), as rows; `history` is that client's, the arm's server at `url` renders."""
    records = [read(ex) for ex in tap.take()]
    for i, record in enumerate(records, 1):
        ideal = await _ideal(client, url, record, history)
        row = Row(
            name,
            arm,
            label,
            i,
            record.decision,
            record.cache_n,
            record.prompt_n,
            ideal,
            record.error,
            record.evaluated,
        )
        result.rows.append(row)
        progress(
            f"  {LABELS[name]} turn {label}.{i}: {row.decision} "
            f"{row.cache_n}/{row.presented} from cache, ideal {row.ideal}"
            + (f" ERROR {row.error}" if row.error else "")
        )


async def take_every_slot(client: Client, url: str, slots: int, facts: int, round_: int) -> None:
    """As many other conversations as there are slots, all at once, so each holds a slot of
    its own: whatever a slot held goes to disk (kvproxy) or is overwritten (the server
    alone). One after another would not do: kvproxy gives the second the first one's slot
    when that is the better one to lose."""
    bodies = [first_turn(100 + 10 * round_ + k, facts) for k in range(slots)]
    replies = await asyncio.gather(*(client.chat(url, messages, 4) for messages in bodies))
    for reply in replies:
        if reply.error:
            raise RuntimeError(f"an evicting conversation failed: {reply.error}")


async def _ideal(client: Client, url: str, record: Record, history: list[list[int]]) -> int | None:
    """The longest common token prefix of this request's prompt with anything an earlier
    request left: its prompt, or its prompt + reply (the template's rendering of the
    conversation ending in the reply). Then this request joins the history."""
    if not record.prompt:
        return None
    fields = {k: v for k, v in record.prompt.items() if k != "messages"}
    messages = record.prompt["messages"]
    now = await client.prompt_tokens(url, messages, True, **fields)
    ideal = max((shared_prefix(now, earlier) for earlier in history), default=None)
    history.append(now)
    if record.reply:
        full = [*messages, record.reply]
        history.append(await client.prompt_tokens(url, full, False, **fields))
    return ideal
