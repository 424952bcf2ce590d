"""The random-weight GGUF writers the tests use; they live in kvproxy_bench.ggufmodels, which
`kvproxy bench big` shares. `python -m tests.ggufmodels fim PATH` writes the FIM-capable tiny
model (e.g. for `kvproxy bench fim --model PATH`)."""

from __future__ import annotations

import sys

from kvproxy_bench.ggufmodels import (
    BIG_VERSION,
    CHAT_TEMPLATE,
    FIM_PIECES,
    GENERATOR_VERSION,
    HYBRID_LAYERS,
    KV_BYTES_PER_TOKEN_F16,
    N_EMBD,
    N_VOCAB,
    VOCAB_TOKENS,
    WRITERS,
    big_model_file,
    main,
    model_files,
    write_big_llama,
    write_dense_llama,
    write_hybrid,
    write_mamba,
)

__all__ = [
    "BIG_VERSION",
    "CHAT_TEMPLATE",
    "FIM_PIECES",
    "GENERATOR_VERSION",
    "HYBRID_LAYERS",
    "KV_BYTES_PER_TOKEN_F16",
    "N_EMBD",
    "N_VOCAB",
    "VOCAB_TOKENS",
    "WRITERS",
    "big_model_file",
    "model_files",
    "write_big_llama",
    "write_dense_llama",
    "write_hybrid",
    "write_mamba",
]

if __name__ == "__main__":
    main(sys.argv[1:], prog="python -m tests.ggufmodels")
