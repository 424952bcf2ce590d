"""The fake server's slot save files, laid out as llama.cpp's `llama_state_seq_save_file`
writes them: the state header, the server's token words (`server_tokens::serialize`), then
the KV cells (16 bytes a token here); and the checks a restore makes before it touches the
slot, with the server's messages."""

from __future__ import annotations

import struct

from kvproxy_fake.model import N_VOCAB

STATE_MAGIC = 0x67677371  # "ggsq"
STATE_VERSION = 4
TOKENS_STATE_VERSION = 1
KV_BYTES_PER_TOKEN = 16
KV_MAGIC = 0x4B56
SIDECAR_SUFFIX = ".ckpt"
SIDECAR_SIZE = 384
BAD_FILE = "No available space in KV cache or invalid slot save file"


def encode_state(tokens: list[int]) -> bytes:
    n = len(tokens)
    words = [-1, TOKENS_STATE_VERSION, n, *tokens, 0]
    kv = struct.pack("<I", n) + b"".join(
        struct.pack("<4i", tok, pos, tok ^ pos, KV_MAGIC) for pos, tok in enumerate(tokens)
    )
    return struct.pack(f"<III{len(words)}i", STATE_MAGIC, STATE_VERSION, len(words), *words) + kv


def encode_sidecar(n_tokens: int) -> bytes:
    """A context-checkpoint file as builds with checkpoints write beside the state."""
    return (b"FAKECKPT" + struct.pack("<I", n_tokens)).ljust(SIDECAR_SIZE, b"\0")


def decode_state(data: bytes, n_ctx: int) -> tuple[list[int], int]:
    """The tokens of a save file and where its KV cells end; ValueError with the server's
    message when it would refuse the file."""
    if len(data) < 12:
        raise ValueError(BAD_FILE)
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    if magic != STATE_MAGIC or version != STATE_VERSION or 12 + 4 * n_words > len(data):
        raise ValueError(BAD_FILE)
    words = list(struct.unpack_from(f"<{n_words}i", data, 12))
    off = 12 + 4 * n_words
    if len(data) < off + 4:
        raise ValueError(BAD_FILE)
    (n_cells,) = struct.unpack_from("<I", data, off)
    kv_end = off + 4 + KV_BYTES_PER_TOKEN * n_cells
    if len(data) < kv_end or n_cells > n_ctx:
        raise ValueError(BAD_FILE)
    if words and words[0] == -1:
        if len(words) < 3 or words[1] != TOKENS_STATE_VERSION:
            raise ValueError("Unsupported server tokens state version")
        n_tok = words[2]
        if n_tok < 0 or len(words) < 4 + n_tok:
            raise ValueError("Cannot read server tokens state")
        tokens = words[3 : 3 + n_tok]
        if words[3 + n_tok] != 0:
            raise ValueError("Cannot restore media tokens without an mmproj")
        if len(words) > 4 + n_tok:
            raise ValueError("Trailing data in server tokens state")
    else:
        tokens = words  # plain token list, as written by older servers
    if n_cells != len(tokens):
        raise ValueError(BAD_FILE)
    if len(tokens) > n_ctx:
        raise ValueError("Restored prompt does not fit in the slot context")
    if any(not 0 <= t < N_VOCAB for t in tokens):
        raise ValueError("Invalid tokens in slot save file")
    return tokens, kv_end


def validate_filename(name: str) -> bool:
    """fs_validate_filename from common/common.cpp (without subdirectories)."""
    if not name or len(name.encode()) > 255:
        return False
    for ch in name:
        c = ord(ch)
        if (
            c <= 0x1F
            or c == 0x7F
            or 0x80 <= c <= 0x9F
            or c in (0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF)
            or 0xD800 <= c <= 0xDFFF
            or ch in ':*?"<>|/\\'
        ):
            return False
    if name[0] == " " or name[-1] in " .":
        return False
    return ".." not in name and name != "."
