"""What a model (or adapter, or control vector) file holds, cheaply: a digest of its content.

A path, size and mtime do not tell two files apart: a re-download of another quantisation or
fine-tune at the same path, a variant of the same size, a copy keeping the time. Reading the
whole file would take seconds to minutes on large models; the digest reads what tells them
apart: the GGUF header (every metadata key, the vocabulary, each tensor's name, shape, type
and offset: another quantisation or architecture changes it), the first `TENSOR_SAMPLE` bytes
of every tensor's data (a fine-tune changes every tensor it trains) and `SPREAD` chunks
spread over the whole file. A 250 MB model reads ~2 MB; a 40 GB one a few MB more.

`FileStamp` is what `os.stat` says of the file, to notice that it changed on disk (the
content is read again only when the server that loaded it is seen to start again).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvproxy.server.modelinfo import GGUFFormatError, read_gguf_header

TENSOR_SAMPLE = 4096
SPREAD = 16
SPREAD_CHUNK = 64 * 1024
DEFAULT_ALIGNMENT = 32  # GGUF's, unless `general.alignment` says otherwise


@dataclass(frozen=True)
class FileStamp:
    """A file as `os.stat` sees it: any replacement or rewrite changes one of these."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int


def stamp(path: str | Path) -> FileStamp | None:
    """None when the file cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileStamp(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def content_digest(path: str | Path) -> str:
    """A digest of the file's content (see the module's docstring). Raises OSError."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        digest.update(struct.pack("<Q", size))
        if size == 0:
            return digest.hexdigest()
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            data, offsets = _layout(buf)
            digest.update(buf[:data])
            for offset in offsets:
                at = data + offset
                digest.update(buf[at : at + TENSOR_SAMPLE])
            span = max(size - SPREAD_CHUNK, 0)
            for i in range(SPREAD):
                at = span * i // (SPREAD - 1)
                digest.update(buf[at : at + SPREAD_CHUNK])
    return digest.hexdigest()


def _layout(buf: Any) -> tuple[int, list[int]]:
    """Where a GGUF file's tensor data starts, and each tensor's offset in it; (0, []) for a
    file that is not one (then only the spread chunks are read)."""
    try:
        header = read_gguf_header(buf)
        end, pos = header.endian, header.kv_end
        offsets = []
        for _ in range(header.n_tensors):
            (n,) = struct.unpack_from(end + "Q", buf, pos)
            pos += 8 + n
            (n_dims,) = struct.unpack_from(end + "I", buf, pos)
            pos += 4 + 8 * n_dims + 4
            (offset,) = struct.unpack_from(end + "Q", buf, pos)
            pos += 8
            offsets.append(offset)
    except (GGUFFormatError, struct.error, OverflowError):
        return 0, []
    align = header.meta.get("general.alignment")
    align = align if isinstance(align, int) and align > 0 else DEFAULT_ALIGNMENT
    data = min(-(-pos // align) * align, len(buf))
    return data, offsets
