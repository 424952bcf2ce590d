"""What prefill costs a token on a server, measured from its own cold prefills, and so how
much time a reply's cached tokens saved.

A reply's own `prompt_ms / prompt_n` is no price for its cached tokens: a cache hit prefills
a few new tokens, and the server evaluates a short batch at nearly the cost of a long one,
so per token it is dearer than the long cold prefill the cache avoided (measured with Gemma
3 270M on 2 cores: 20 s claimed for a 4,941-token hit whose cold prefill took 10 s; the issue
that reported it saw tenfold). The price is learnt instead from prefills of many tokens with
little cache, per server and model, over the last few of them: replies, and kvproxy's own
evaluations (a new conversation's opening is prefilled by one, its reply then prefills a
few tokens). Linear in the tokens: long contexts cost somewhat more a token than the
average of the prefills seen (attention grows with the context), so the estimate errs low.
No such reply yet: no estimate, not a guess.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# A reply counts as a cold prefill when it prefilled at least this many tokens…
MIN_COLD_TOKENS = 256
# …and reused from the cache at most this share of what it prefilled.
MAX_COLD_CACHED_SHARE = 0.25
# The cold prefills the price is averaged over (the newest): follows a server that got
# slower or faster (another load on the machine, another build).
WINDOW = 16


@dataclass
class PrefillRates:
    """Per server and model (any string naming them), the recent cold prefills."""

    samples: dict[str, deque[tuple[int, float]]] = field(default_factory=dict)

    def observe(self, model: str, cache_n: int | None, prompt_n: int, prompt_ms: float) -> None:
        """A reply's `timings`: kept when it was a cold prefill."""
        if prompt_n < MIN_COLD_TOKENS or prompt_ms <= 0:
            return
        if (cache_n or 0) > prompt_n * MAX_COLD_CACHED_SHARE:
            return
        self.samples.setdefault(model, deque(maxlen=WINDOW)).append((prompt_n, prompt_ms))

    def ms_per_token(self, model: str) -> float | None:
        """The cold prefill price, ms a token; None before a cold prefill was seen."""
        seen = self.samples.get(model)
        if not seen:
            return None
        return sum(ms for _, ms in seen) / sum(n for n, _ in seen)

    def saved_s(self, model: str, cache_n: int | None, restore_ms: float = 0.0) -> float | None:
        """Seconds the cache saved a reply that reused `cache_n` tokens: their cold prefill,
        less the time spent restoring them (never below zero). None when not known."""
        if cache_n is None:
            return None
        rate = self.ms_per_token(model)
        if rate is None:
            return None
        return max(cache_n * rate - restore_ms, 0.0) / 1000
