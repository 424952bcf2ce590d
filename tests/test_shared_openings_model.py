"""A model-based test of sessions that share openings, at once (hypothesis stateful).

Main sessions of two agents (each agent's sessions share its system prompt) grow turn by
turn; several turns go at once, so replies end together; sub-agent windows (new sessions
of the same system prompt, a turn or two) come between main turns; a client hangs up
mid-reply; 1–4 slots; a server that reuses any common prefix, or (recurrent-like) a restored
state only when the prompt extends it. After every step:

- no state kvproxy could still save was lost (the fake server's ledger, tests/ledger.py);
- every decision label is true: a returning session gets back at least its previous prompt
  (it is resident or restored, never a miss: its state is on disk or in a slot), and a
  `resident` new session reuses at least the system prompt it shares.

One agent's system prompt is long enough to be presumed an opening (cache/prefixes/openings.py), so new
sessions starting at once also meet the path where one evaluates it and the others wait
and restore it. `KVPROXY_MODEL_EXAMPLES=200` runs more examples than `make test`'s 25.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from kvproxy_fake.model import render_chat, tokenize

from .conftest import RunningProxy, start_proxy
from .ledger import REWRITABLE_TAIL, LedgerServer

SYSTEMS = [
    f"You are agent {name}. Work carefully through the task.\n" + f"{name} rule. " * n
    for name, n in (("alpha", 80), ("beta", 360))
]
MAX_SESSIONS = 4


@dataclass
class Session:
    name: str
    system: int
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0  # turns whose state the session may expect back (replied or cut off)

    def prompt_tokens(self) -> int:
        """Tokens of the prompt its last request sent: what its next turn must get back."""
        return len(tokenize(render_chat(self.messages), add_special=True))


def system_tokens(system: int) -> int:
    msgs = [{"role": "system", "content": SYSTEMS[system]}]
    return len(tokenize(render_chat(msgs, add_generation_prompt=False), add_special=True))


@dataclass
class Answer:
    status: int
    decision: str
    cache_n: int
    body: dict[str, Any]


class SharedOpenings(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory()
        self.fake: LedgerServer | None = None
        self.proxy: RunningProxy | None = None
        self.sessions: list[Session] = []
        self.made = 0
        self.wrong: list[str] = []

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    @initialize(n_slots=st.integers(1, 4), reuse=st.sampled_from(["full", "extend"]))
    def start(self, n_slots: int, reuse: str) -> None:
        cache = Path(self.tmp.name)
        self.fake = LedgerServer(
            slot_save_path=cache, n_slots=n_slots, reuse=reuse, token_delay=0.001, n_ctx=16384
        )
        self.run(self.fake.start())
        self.proxy = self.run(start_proxy(self.fake.url, cache))

    def teardown(self) -> None:
        if self.proxy is not None:
            self.run(self.proxy.stop())
        if self.fake is not None:
            self.run(self.fake.stop())
        self.loop.close()
        self.tmp.cleanup()

    # --- requests

    async def _ask(self, session: Session, stream: bool = False) -> Answer:
        assert self.proxy is not None
        async with (
            aiohttp.ClientSession() as s,
            s.post(
                self.proxy.url + "/v1/chat/completions",
                json={"messages": session.messages, "stream": stream},
            ) as r,
        ):
            raw = await r.read()
            body = orjson.loads(raw) if not stream else {}
            timings = body.get("timings") or {}
            return Answer(
                r.status, r.headers.get("X-KVProxy-Cache", ""), timings.get("cache_n", 0), body
            )

    async def _all(self, sessions: list[Session]) -> list[Answer]:
        return list(await asyncio.gather(*(self._ask(s) for s in sessions)))

    async def _hang_up(self, session: Session) -> None:
        assert self.proxy is not None
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                self.proxy.url + "/v1/chat/completions",
                json={"messages": session.messages, "stream": True},
            )
            await resp.content.readline()
            resp.close()

    def _turn(self, sessions: list[Session]) -> None:
        """The next turn of each session, all at once; the labels checked."""
        expected = [
            (s.turns, s.prompt_tokens() if s.turns else system_tokens(s.system)) for s in sessions
        ]
        for s in sessions:
            s.messages.append({"role": "user", "content": f"{s.name} turn {s.turns + 1}: go on"})
        answers = self.run(self._all(sessions))
        for s, a, (turns, floor) in zip(sessions, answers, expected, strict=True):
            if a.status != 200:
                self.wrong.append(f"{s.name}: status {a.status} {a.body}")
                continue
            if turns and (
                a.decision not in ("resident", "restored") or a.cache_n < floor - REWRITABLE_TAIL
            ):
                self.wrong.append(
                    f"{s.name} turn {turns + 1}: {a.decision} with cache_n {a.cache_n}, "
                    f"its previous prompt was {floor} tokens"
                )
            if not turns and a.decision == "resident" and a.cache_n < floor - 2:
                self.wrong.append(
                    f"{s.name} (new): resident with cache_n {a.cache_n} < opening {floor}"
                )
            msg = a.body["choices"][0]["message"]
            s.messages.append({"role": "assistant", "content": msg["content"]})
            s.turns += 1

    def _new(self, system: int, prefix: str = "s") -> Session:
        self.made += 1
        return Session(
            f"{prefix}{self.made}", system, [{"role": "system", "content": SYSTEMS[system]}]
        )

    # --- rules

    @precondition(lambda self: len(self.sessions) < MAX_SESSIONS)
    @rule(system=st.integers(0, 1))
    def start_session(self, system: int) -> None:
        session = self._new(system)
        self.sessions.append(session)
        self._turn([session])

    @precondition(lambda self: bool(self.sessions))
    @rule(data=st.data())
    def turns_at_once(self, data: st.DataObject) -> None:
        chosen = data.draw(
            st.lists(st.sampled_from(self.sessions), min_size=1, max_size=3, unique_by=id)
        )
        self._turn(chosen)

    @precondition(lambda self: bool(self.sessions))
    @rule(data=st.data(), turns=st.integers(1, 2))
    def subagent_window(self, data: st.DataObject, turns: int) -> None:
        parent = data.draw(st.sampled_from(self.sessions))
        sub = self._new(parent.system, "sub")
        for _ in range(turns):
            self._turn([sub])

    @precondition(lambda self: bool(self.sessions))
    @rule(data=st.data())
    def hang_up(self, data: st.DataObject) -> None:
        session = data.draw(st.sampled_from(self.sessions))
        session.messages.append({"role": "user", "content": f"{session.name}: never mind"})
        self.run(self._hang_up(session))
        self.run(asyncio.sleep(0.05))
        # The user goes on from the interrupted prompt, as a client does after Esc: its next
        # turn must find that prompt resident (or on disk).

    @precondition(lambda self: len(self.sessions) > 1)
    @rule(data=st.data())
    def session_ends(self, data: st.DataObject) -> None:
        self.sessions.remove(data.draw(st.sampled_from(self.sessions)))

    # --- after every step

    @invariant()
    def nothing_unsaved_was_lost(self) -> None:
        if self.fake is not None:
            assert self.fake.lost == [], "\n".join(map(str, self.fake.lost))

    @invariant()
    def every_label_was_true(self) -> None:
        assert self.wrong == [], "\n".join(self.wrong)


def test_sessions_sharing_openings_keep_every_state_and_true_labels() -> None:
    run_state_machine_as_test(
        SharedOpenings,
        settings=settings(
            max_examples=int(os.environ.get("KVPROXY_MODEL_EXAMPLES", 25)),
            stateful_step_count=12,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
