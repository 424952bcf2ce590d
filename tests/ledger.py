"""A fake llama-server that keeps a ledger of every state a completion leaves in a slot, and
records each one lost: overwritten by a completion that does not go on from it, a restore or
an erase, while it was on disk nowhere.

What the server sees is all it judges by: a completion "goes on from" a state when its prompt
keeps the whole prompt that made the state (a next turn, a regenerated reply, kvproxy's own
canonical-prefix evaluation before a save). Anything else replaces the state; if no save of
the slot came after it was made, the state is gone for good (the invariant the cache keeps:
tests/test_shared_openings.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvproxy_fake.model import common_prefix, detokenize
from kvproxy_fake.server import FakeLlamaServer, FakeSlot, _Ticket

from kvproxy.server import probe


@dataclass
class Made:
    """A state a completion left in a slot."""

    tokens: list[int]
    prompt_len: int  # tokens of the prompt that made it: what a request must keep to go on
    saved: bool = False


@dataclass(frozen=True)
class Lost:
    slot: int
    by: str  # "completion", "restore", "erase"
    n_tokens: int
    kept: int  # tokens of the state's prompt the overwriting content kept
    head: str  # the state's text around where it was overwritten, for the failure message

    def __str__(self) -> str:
        return (
            f"slot {self.slot}: an unsaved {self.n_tokens}-token state lost to a {self.by} "
            f"(kept {self.kept} tokens of its prompt): …{self.head}…"
        )


# A prompt ends with the generation prompt (`<start_of_turn>model\n`); a client that sends
# another user message after an unanswered one (a hang-up, then "never mind") rewrites its
# last `model\n`: the server reuses all the rest, so nothing of value is lost.
REWRITABLE_TAIL = len("model\n")


class LedgerServer(FakeLlamaServer):
    def __init__(self, *, min_tokens: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.min_tokens = min_tokens
        self.made: dict[int, Made] = {}
        self.running: dict[int, int] = {}  # slot -> prompt length of the completion on it
        self.lost: list[Lost] = []

    # --- the checks

    def _replaced(self, slot: FakeSlot, content: list[int], by: str) -> None:
        made = self.made.get(slot.id)
        if made is None or made.saved or len(made.tokens) < self.min_tokens:
            return
        kept = common_prefix(made.tokens, content)
        if kept >= made.prompt_len - REWRITABLE_TAIL:
            return  # goes on from it
        head = detokenize(made.tokens[max(kept - 30, 0) : kept + 30])
        self.lost.append(Lost(slot.id, by, len(made.tokens), kept, head))

    # --- hooks on the fake's scheduling and slot actions

    def _try_run(self, ticket: _Ticket) -> bool:
        slot = self._pick_slot(ticket)
        if ticket.action is None and slot is not None and not slot.is_processing:
            self._replaced(slot, ticket.prompt, "completion")
            self.running[slot.id] = len(ticket.prompt)
        return super()._try_run(ticket)

    def _release(self, slot: FakeSlot) -> None:
        if slot.is_processing and slot.id in self.running:
            prompt_len = self.running.pop(slot.id)
            made = Made(list(slot.tokens), min(prompt_len, len(slot.tokens)))
            # kvproxy's behavioural probe (server/probe.py) leaves nothing of value.
            made.saved = probe.PROMPT in detokenize(slot.tokens)
            self.made[slot.id] = made
        super()._release(slot)

    def _save(self, slot: FakeSlot, id_slot: int, filename: str) -> tuple[int, Any]:
        status, body = super()._save(slot, id_slot, filename)
        made = self.made.get(slot.id)
        if (
            status == 200
            and made is not None
            and common_prefix(made.tokens, slot.tokens) >= (made.prompt_len - REWRITABLE_TAIL)
        ):
            made.saved = True
        return status, body

    def _restore(self, slot: FakeSlot, id_slot: int, filename: str) -> tuple[int, Any]:
        try:
            tokens, _ = self._read_state(self.save_dir / filename, slot.n_ctx)
        except ValueError:
            tokens = []
        self._replaced(slot, tokens, "restore")
        status, body = super()._restore(slot, id_slot, filename)
        self.made[slot.id] = Made(list(slot.tokens), len(slot.tokens), saved=True)
        return status, body

    def _erase(self, slot: FakeSlot, id_slot: int) -> tuple[int, Any]:
        self._replaced(slot, [], "erase")
        self.made.pop(slot.id, None)
        return super()._erase(slot, id_slot)
