"""The fake llama-server lives in kvproxy.testing.fakeserver (benchmarks run it too); these are
the names the tests import from here."""

from kvproxy.testing.fakeserver import (
    BOS,
    EOS,
    FakeLlamaServer,
    common_prefix,
    render_chat,
    tokenize,
)

__all__ = ["BOS", "EOS", "FakeLlamaServer", "common_prefix", "render_chat", "tokenize"]
