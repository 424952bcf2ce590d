"""How the cache commands print: tables, sizes, ages, progress."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TextIO

PROGRESS_MIN = 100  # operations on at least this many entries report progress on stderr


def table(header: list[str], rows: Iterable[list[str]], right: set[int]) -> None:
    rows = list(rows)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)
        ]
        print("  ".join(cells).rstrip())


def entries_(n: int, counted: bool = True) -> str:
    word = "entry" if n == 1 else "entries"
    return f"{n:,} {word}" if counted else word


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def human_age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            whole = int(seconds // size)
            rest = int((seconds - whole * size) // {"d": 3600, "h": 60, "m": 1}[unit])
            small = {"d": "h", "h": "m", "m": "s"}[unit]
            return f"{whole}{unit}{rest}{small}" if rest and whole < 10 else f"{whole}{unit}"
    return f"{int(seconds)}s"


class Progress:
    """Progress of a long operation on stderr: a line every 10% (in place on a terminal)."""

    def __init__(self, what: str, total: int, out: TextIO | None = None) -> None:
        self.what, self.total, self.done = what, total, 0
        self.out = out or sys.stderr
        self.shown = total >= PROGRESS_MIN
        self.tty = self.out.isatty()
        self._next = 0

    def __enter__(self) -> Progress:
        return self

    def step(self) -> None:
        self.done += 1
        if self.shown and (self.done >= self._next or self.done == self.total):
            pct = 100 * self.done // self.total
            end = "\r" if self.tty and self.done < self.total else "\n"
            print(f"{self.what} {self.done}/{self.total} ({pct}%)", end=end, file=self.out)
            self.out.flush()
            self._next = self.done + max(1, self.total // 10)

    def __exit__(self, *exc: object) -> None:
        if self.shown and self.done and self.done < self.total:
            print(file=self.out)  # leave the terminal on a fresh line after an error


class Ticker:
    """One line rewritten in place on a terminal while the user waits (llama-server loading
    its model); `for_terminal` gives None when stderr is not a terminal, so logs stay quiet."""

    def __init__(self, what: str, out: TextIO) -> None:
        self.what, self.out = what, out
        self._shown = -1

    @classmethod
    def for_terminal(cls, what: str, out: TextIO | None = None) -> Ticker | None:
        out = out or sys.stderr
        return cls(what, out) if out.isatty() else None

    def show(self, elapsed: float) -> None:
        whole = int(elapsed)
        if whole >= 1 and whole != self._shown:  # from 1 s: a fast start shows nothing
            self.out.write(f"\r\x1b[K{self.what}… {whole} s")
            self.out.flush()
            self._shown = whole

    def done(self) -> None:
        if self._shown >= 0:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._shown = -1
