"""`kvproxy bench big`'s tables and its plot — on plain data (big.py's records; the figures
the targets judge: big_targets.py)."""

from __future__ import annotations

import statistics
from pathlib import Path

from kvproxy_bench.arms import DIRECT_NO_CACHE, DIRECT_RAM_CACHE, KVPROXY
from kvproxy_bench.big_log import gib
from kvproxy_bench.big_proxied import BUSY
from kvproxy_bench.big_records import BigResult, Returning, SizePoint
from kvproxy_bench.big_stream import gaps_ms, p50, p99
from kvproxy_bench.big_targets import (
    action,
    big_saves,
    checks,
    fmt_rate,
    fmt_t,
    fmt_x,
    gap_ratio,
    ratio_of,
    restore_vs_disk,
    rss_growth,
    server_alone,
    speedup,
    state_of,
    stream_run,
    tokens_of,
    worst_save_gap,
)
from kvproxy_bench.report import table

__all__ = ["checks", "markdown", "plot"]


def markdown(result: BigResult) -> str:
    pts = result.points
    parts = [
        "Returning conversation, evicted by others first: time to first token",
        _returning(pts),
        "Restore against the disk's own read of the same file (kvproxy ÷ disk: read time ÷ "
        "restore time; the server alone restores its own save of the same size, server ÷ disk "
        "scales the read to its size)",
        _restores(pts),
        "What kvproxy adds to the server's own restore (the server alone restoring its save of "
        "the same size: `timings.restore_ms`), and what the request met meanwhile",
        _added(pts),
        "Saves against the disk's write of the same size",
        _saves(pts),
        "A token stream on one slot while a big state is saved on another (gaps in ms)",
        _streams(pts),
        "kvproxy's memory (VmRSS, sampled every 0.25 s through its arm)",
        _rss(pts),
        "SIGTERM after every slot got a new turn: once they idled (saved), and at once",
        _shutdown(pts),
        "Disk kept for the returning conversation after its turns",
        _kept(pts),
    ]
    text = "\n\n".join(f"**{p}**" if i % 2 == 0 else p for i, p in enumerate(parts))
    errors = [f"- {p.size:,}: {e}" for p in pts for e in p.errors]
    errors += [
        f"- {p.size:,}, {r.arm}, {r.what}: {r.error}" for p in pts for r in p.returning if r.error
    ]
    return text + ("\n\nErrors:\n" + "\n".join(errors) if errors else "")


def _ttft(r: Returning | None, cached: bool = False) -> str | None:
    if r is None or r.error or not r.ttft_s:
        return None
    return f"{fmt_t(r.ttft_s)} ({r.cached:,} cached)" if cached else fmt_t(r.ttft_s)


def _returning(pts: list[SizePoint]) -> str:
    rows, ratios = [], []
    for p in pts:
        again = p.find(DIRECT_NO_CACHE, "re-prefill")
        rates = ", ".join(
            f"{k.replace('direct, ', '').replace(', turn 1', '')} {v:.0f}"
            for k, v in p.prefill_rates.items()
        )
        rows.append(
            [
                tokens_of(p),
                gib(state_of(p)) if state_of(p) else None,
                _ttft(again),
                _ttft(p.find(DIRECT_RAM_CACHE, "returning"), cached=True),
                _ttft(p.find(DIRECT_NO_CACHE, "resident"), cached=True),
                _ttft(p.find(KVPROXY, BUSY), cached=True),
                _ttft(p.find(KVPROXY, "cold"), cached=True),
                _ttft(p.find(KVPROXY, "warm"), cached=True),
            ]
        )
        ratios.append(
            [
                tokens_of(p),
                fmt_x(speedup(p, BUSY)),
                fmt_x(speedup(p)),
                fmt_x(speedup(p, "warm")),
                fmt_x(speedup(p, "resident", DIRECT_NO_CACHE)),
                rates or None,
            ]
        )
    cols = [
        "tokens",
        "state",
        "no cache: re-prefill",
        "server's RAM cache",
        "server, still resident",
        "kvproxy, cold, right after the others",
        "kvproxy, cold, idle",
        "kvproxy, warm, idle",
    ]
    ratio_cols = [
        "tokens",
        "re-prefill ÷ kvproxy: cold, right after the others",
        "cold, idle",
        "warm, idle",
        "re-prefill ÷ server resident",
        "cold prefills, tok/s (A's turn 1 per arm)",
    ]
    return table(cols, rows) + "\n\n" + table(ratio_cols, ratios)


def _restores(pts: list[SizePoint]) -> str:
    rows: list[list[object]] = []
    for p in pts:
        row: list[object] = [tokens_of(p)]
        for what, read_of in (("cold", "cold_read_s"), ("warm", "warm_read_s")):
            r, server = p.find(KVPROXY, what), action(p, f"restore {what}")
            size = r.state_bytes if r is not None else 0
            read = getattr(r, read_of) if r is not None else None
            restore = r.restore_ms / 1000 if r is not None and r.cache_state == "restored" else None
            server_s = server.server_ms / 1000 if server and server.server_ms else None
            row += [
                gib(size) if size else None,
                _timed(size, read),
                _timed(server.bytes, server_s) if server else None,
                _timed(size, restore),
                fmt_x(restore_vs_disk(p, what)),
                fmt_x(_scaled(read, size, server.bytes, server_s)) if server else None,
            ]
        rows.append(row)
    cols = ["tokens"]
    for what in ("cold", "warm"):
        cols += [
            f"{what}: state",
            "disk read",
            "server restore",
            "kvproxy restore",
            "kvproxy ÷ disk",
            "server ÷ disk",
        ]
    return table(cols, rows)


def _timed(n_bytes: float, seconds: float | None) -> str | None:
    return f"{fmt_t(seconds)}, {fmt_rate(n_bytes, seconds)}" if seconds else None


def _scaled(read: float | None, size: int, other: int, seconds: float | None) -> float | None:
    """The disk's read time of `size` bytes scaled to `other` bytes, over `seconds`."""
    return ratio_of(read * other / size, seconds) if read and size else None


def _added(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        for what in (BUSY, "cold", "warm"):
            r = p.find(KVPROXY, what)
            kind = "warm" if what == "warm" else "cold"
            own = action(p, f"restore {kind}")
            if r is None:
                continue
            server_s = own.server_ms / 1000 if own is not None and own.server_ms else None
            added = r.ttfb_s - server_s if server_s and r.ttfb_s else None
            rows.append(
                [
                    tokens_of(p),
                    what,
                    fmt_t(server_s),
                    fmt_t(r.restore_ms / 1000) if r.cache_state == "restored" else r.cache_state,
                    fmt_t(r.ttfb_s),
                    None if added is None else f"{added:+.2f} s",
                    fmt_t(r.ttft_s),
                    f"{fmt_t(r.prompt_ms / 1000)} ({r.tokens - r.cached} tokens)"
                    if r.prompt_ms
                    else None,
                    fmt_t(server_alone(p, kind)),
                    "; ".join(r.waited) or "nothing logged",
                ]
            )
    cols = [
        "tokens",
        "return",
        "server alone: its restore",
        "kvproxy: its restore call",
        "first byte",
        "first byte − server's restore",
        "first token",
        "of which its new tokens' prefill",
        "server alone: restore + new turn",
        "meanwhile (kvproxy's log)",
    ]
    return table(cols, rows)


def _saves(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        server, disk, saves = action(p, "save"), p.disk, big_saves(p)
        median = statistics.median(s.ms for s in saves) / 1000 if saves else None
        canonical = statistics.median(s.canonical_ms for s in saves) / 1000 if saves else None
        size = statistics.median(s.bytes for s in saves) if saves else 0
        background = sum(s.background for s in saves)
        rows.append(
            [
                tokens_of(p),
                gib(server.bytes) if server else None,
                _timed(server.bytes, server.server_ms / 1000) if server else None,
                f"{len(saves)} ({len(saves) - background} on a path, {background} background)",
                f"{fmt_t(median)}, {fmt_rate(size, median)}" if median else None,
                fmt_t(canonical),
                f"{fmt_t(disk.write_s)}, {fmt_rate(disk.bytes, disk.write_s)}" if disk else None,
                f"{fmt_t(disk.total_s)}, {fmt_rate(disk.bytes, disk.total_s)}" if disk else None,
                fmt_x(ratio_of(median, disk.total_s)) if disk else None,
            ]
        )
    cols = [
        "tokens",
        "state",
        "server's save (page cache)",
        "kvproxy's saves",
        "kvproxy save, median",
        "its canonical pass",
        "disk: write",
        "write + fsync",
        "kvproxy save ÷ write+fsync",
    ]
    return table(cols, rows)


def _gaps(times: list[float]) -> str:
    g = gaps_ms(times)
    if not g:
        return "—"
    return f"{p50(g):.0f} / {p99(g):.0f} / {max(g):.0f}"


def _streams(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        for arm in (DIRECT_NO_CACHE, KVPROXY):
            alone, loaded = stream_run(p, arm, "alone"), stream_run(p, arm, "with a save")
            if alone is None or loaded is None:
                continue
            worst = worst_save_gap(loaded)
            saves = [w for w in loaded.windows if w.what == "save"]
            own = action(p, "save during a stream")
            counts = (
                ", ".join(f"{v} {k}" for k, v in loaded.counts.items())
                if loaded.counts
                else f"{len(saves)} save (the server's own"
                + (f": {gib(own.bytes)} in {fmt_t(own.server_ms / 1000)})" if own else ")")
            )
            rows.append(
                [
                    tokens_of(p),
                    arm,
                    _gaps(alone.times),
                    _gaps(loaded.times),
                    None if worst is None else f"{worst:.0f}",
                    fmt_x(gap_ratio(p, arm)),
                    counts,
                ]
            )
    cols = [
        "tokens",
        "arm",
        "alone: p50 / p99 / max",
        "with a save: p50 / p99 / max",
        "longest gap in a save",
        "÷ alone p99",
        "during the stream",
    ]
    return table(cols, rows)


def _rss(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        growth = rss_growth(p)
        if growth is None:
            continue
        phases: dict[str, int] = {}
        for s in p.rss:
            phases[s.phase] = max(phases.get(s.phase, 0), s.rss)
        by_phase = ", ".join(f"{k} {v / 1024**2:.0f}" for k, v in phases.items())
        rows.append(
            [
                tokens_of(p),
                gib(state_of(p)) if state_of(p) else None,
                f"{growth[0] / 1024**2:.0f} MiB",
                f"{(growth[0] + growth[1]) / 1024**2:.0f} MiB",
                f"{growth[1] / 1024**2:+.0f} MiB",
                by_phase,
            ]
        )
    cols = ["tokens", "state", "start", "max", "growth", "max by phase (MiB)"]
    return table(cols, rows)


def _shutdown(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        for s in (p.idle_shutdown, p.shutdown):
            if s is None:
                continue
            back = sum(r.cache_state == "restored" for r in s.back)
            rows.append(
                [
                    tokens_of(p),
                    f"after {s.idled:.0f} s idle (kvproxy saved them)" if s.idled else "at once",
                    f"{s.held_slots} ({gib(s.held_bytes)})",
                    f"{s.unsaved_slots} ({gib(s.unsaved_bytes)})",
                    f"{s.seconds:.1f} s" + ("" if s.exit_code == 0 else f" (exit {s.exit_code})"),
                    f"{len(s.saves)} ({gib(sum(x.bytes for x in s.saves))})",
                    "; ".join(s.lost) or "nothing",
                    f"{back}/{len(s.back)}",
                ]
            )
    cols = [
        "tokens",
        "SIGTERM after the new turns",
        "slots held",
        "unsaved at SIGTERM",
        "SIGTERM → exit",
        "saved on the way out",
        "lost (kvproxy's log)",
        "restored after restart",
    ]
    return table(cols, rows)


def _kept(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        k = p.kept
        if k is None:
            continue
        rows.append(
            [
                tokens_of(p),
                k.turns,
                k.files,
                gib(k.bytes),
                gib(k.newest_bytes),
                fmt_x(ratio_of(k.bytes, k.newest_bytes)),
                f"{k.dir_files} files, {gib(k.dir_bytes)}",
            ]
        )
    cols = ["tokens", "turns", "its files", "on disk", "newest state", "÷ newest", "cache dir"]
    return table(cols, rows)


def plot(result: BigResult, path: Path) -> None:
    """Left: TTFT of the returning conversation per arm and size (log). Right: throughput
    of the disk's read and of the restores, cold and warm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pts = result.points
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    bars = [
        ("re-prefill (no cache)", DIRECT_NO_CACHE, "re-prefill", "tab:red"),
        ("server's RAM cache", DIRECT_RAM_CACHE, "returning", "tab:orange"),
        ("kvproxy, cold, right after the others", KVPROXY, BUSY, "tab:purple"),
        ("kvproxy, cold, idle", KVPROXY, "cold", "tab:blue"),
        ("kvproxy, warm, idle", KVPROXY, "warm", "tab:cyan"),
    ]
    width = 0.8 / len(bars)
    labels = [f"{tokens_of(p):,}\n{gib(state_of(p))}" for p in pts]
    for i, (label, arm, what, color) in enumerate(bars):
        ys = [(r.ttft_s if (r := p.find(arm, what)) and not r.error else 0.0) for p in pts]
        left.bar([k + i * width for k in range(len(pts))], ys, width, label=label, color=color)
    left.set_yscale("log")
    left.set_xticks([k + 0.4 - width / 2 for k in range(len(pts))], labels)
    left.set_ylabel("time to first token (s)")
    left.set_title("Returning conversation")
    left.legend(fontsize=8)
    left.grid(True, axis="y", which="both", alpha=0.3)
    series = [
        ("disk read, cold", "cold", "read", "tab:gray"),
        ("kvproxy restore, cold", "cold", "restore", "tab:blue"),
        ("disk read, warm", "warm", "read", "silver"),
        ("kvproxy restore, warm", "warm", "restore", "tab:cyan"),
    ]
    width = 0.8 / len(series)
    for i, (label, what, kind, color) in enumerate(series):
        ys = []
        for p in pts:
            r = p.find(KVPROXY, what)
            secs = None
            if r is not None and r.state_bytes:
                read = r.cold_read_s if what == "cold" else r.warm_read_s
                secs = read if kind == "read" else r.restore_ms / 1000
            ys.append(r.state_bytes / secs / 1e9 if r is not None and secs else 0.0)
        right.bar([k + i * width for k in range(len(pts))], ys, width, label=label, color=color)
    right.set_xticks([k + 0.4 - width / 2 for k in range(len(pts))], labels)
    right.set_ylabel("GB/s")
    right.set_title("Restore vs the disk's read of the same file")
    right.legend(fontsize=8)
    right.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
