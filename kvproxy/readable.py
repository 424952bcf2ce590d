"""Sizes, durations and rates as people read them, whatever their scale: `1.2 GiB`, not
1288490188 bytes; `2.4 s`, not 2431.7 ms. The one formatter of the log, `kvproxy ls`,
`kvproxy stats` and the shutdown's lines (the status page's script follows the same rules)."""

from __future__ import annotations

UNITS = ("KiB", "MiB", "GiB", "TiB")


def size(n_bytes: float) -> str:
    """`512 B`, `3.5 KiB`, `1.2 GiB`: binary units, one decimal."""
    if n_bytes < 1024:
        return f"{n_bytes:.0f} B"
    value = float(n_bytes)
    for unit in UNITS:
        value /= 1024
        if round(value, 1) < 1024 or unit == UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def duration(seconds: float, sep: str = " ") -> str:
    """`6.1 ms`, `240 ms`, `2.4 s`, `3.5 min`, `2.1 h` (`sep=""`: `2.4s`, for key=value
    lines)."""
    seconds = max(0.0, seconds)
    if seconds < 0.01:
        return f"{seconds * 1000:.1f}{sep}ms"
    if seconds < 0.9995:
        return f"{seconds * 1000:.0f}{sep}ms"
    if seconds < 119.95:
        return f"{seconds:.1f}{sep}s"
    if seconds < 7197:
        return f"{seconds / 60:.1f}{sep}min"
    return f"{seconds / 3600:.1f}{sep}h"


def rate(bytes_per_s: float) -> str:
    """`450.0 MiB/s`, `1.4 GiB/s`."""
    return f"{size(bytes_per_s)}/s"
