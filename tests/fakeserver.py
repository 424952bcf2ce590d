"""The fake llama-server lives in kvproxy_fake (bench/kvproxy_fake) (benchmarks run it too); these are the names
the tests import from here."""

from kvproxy_fake.model import BOS, EOS, common_prefix, render_chat, tokenize
from kvproxy_fake.server import FakeLlamaServer

__all__ = ["BOS", "EOS", "FakeLlamaServer", "common_prefix", "render_chat", "tokenize"]
