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
    """A long operation's progress on a terminal: one line rewritten in place
    (`evicting 5,000/10,000 (50%)`), cleared when it ends. Nothing when stderr is not a
    terminal (a log, a pipe) or for fewer than PROGRESS_MIN steps: the result line says it."""

    def __init__(self, what: str, total: int, out: TextIO | None = None) -> None:
        self.out = out or sys.stderr
        self.tty = self.out.isatty()
        self.what, self.total, self.done = what, total, 0
        self._shown = -1  # the percentage on the line now

    def __enter__(self) -> Progress:
        return self

    def step(self) -> None:
        self.report(self.what, self.done + 1, self.total)

    def report(self, what: str, done: int, total: int) -> None:
        """`done` of `total` (a phase of its own when `what` changes)."""
        if what != self.what:
            self.what, self._shown = what, -1
        self.done, self.total = done, total
        if not self.tty or total < PROGRESS_MIN:
            return
        pct = 100 * done // total
        if pct != self._shown:
            self.out.write(f"\r\x1b[K{what} {done:,}/{total:,} ({pct}%)")
            self.out.flush()
            self._shown = pct

    def __exit__(self, *exc: object) -> None:
        if self._shown >= 0:  # the result (or the error) follows on a clean line
            self.out.write("\r\x1b[K")
            self.out.flush()
            self._shown = -1


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
