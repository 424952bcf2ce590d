"""`kvproxy bench big`'s tables, the targets of "Big states" checked against a run, and its
plot — on plain data (big.py's records)."""

from __future__ import annotations

import statistics
from pathlib import Path

from kvproxy_bench.arms import DIRECT_NO_CACHE, DIRECT_RAM_CACHE, KVPROXY
from kvproxy_bench.big_log import LoggedSave, gib
from kvproxy_bench.big_records import Action, BigResult, Returning, SizePoint, StreamRun
from kvproxy_bench.big_stream import gaps_in, gaps_ms, p50, p99
from kvproxy_bench.report import table
from kvproxy_bench.targets import Check

TTFT_TARGET = 100.0  # × faster than re-prefill, at 8k tokens
TTFT_TARGET_AT = 8192
RESTORE_TARGET = 0.9  # × the disk's read of the same file
GAP_TARGET = 2.0  # × the undisturbed p99 gap
RSS_FLAT_BYTES = 64 * 1024**2  # "flat": growth over the run below this
SHUTDOWN_TARGET_S = 30.0
KEPT_TARGET = 1.5  # × the newest state


def _t(seconds: float | None) -> str | None:
    if not seconds:
        return None
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _rate(n_bytes: float, seconds: float | None) -> str | None:
    return f"{n_bytes / seconds / 1e9:.2f} GB/s" if seconds and n_bytes else None


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}×" if value < 10 else f"{value:.0f}×"


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def _action(point: SizePoint, what: str) -> Action | None:
    return next((a for a in point.actions if a.what == what), None)


def _stream(point: SizePoint, arm: str, what: str) -> StreamRun | None:
    return next((s for s in point.streams if (s.arm, s.what) == (arm, what)), None)


def _tokens(point: SizePoint) -> int:
    for arm, what in ((DIRECT_NO_CACHE, "re-prefill"), (KVPROXY, "cold")):
        r = point.find(arm, what)
        if r is not None and r.tokens:
            return r.tokens
    return point.size


def _state(point: SizePoint) -> int:
    r = point.find(KVPROXY, "cold")
    if r is not None and r.state_bytes:
        return r.state_bytes
    save = _action(point, "save")
    return save.bytes if save is not None else 0


def speedup(point: SizePoint) -> float | None:
    again, cold = point.find(DIRECT_NO_CACHE, "re-prefill"), point.find(KVPROXY, "cold")
    return _ratio(again.ttft_s, cold.ttft_s) if again and cold and not cold.error else None


def restore_vs_disk(point: SizePoint, what: str) -> float | None:
    """Restore throughput over the disk's read of the same file: read time ÷ restore time."""
    r = point.find(KVPROXY, what)
    if r is None or r.cache_state != "restored":
        return None
    read = r.cold_read_s if what == "cold" else r.warm_read_s
    return _ratio(read, r.restore_ms / 1000)


def server_alone(point: SizePoint, what: str) -> float | None:
    """The server alone restoring the same size and answering: its restore call + TTFT."""
    restore = _action(point, f"restore {what}")
    after = point.find(DIRECT_NO_CACHE, "after its restore")
    return restore.wall_s + after.ttft_s if restore and after and after.ttft_s else None


def worst_save_gap(run: StreamRun) -> float | None:
    gaps = gaps_in(run.times, run.windows, "save")
    return max(gaps) if gaps else None


def gap_ratio(point: SizePoint, arm: str = KVPROXY) -> float | None:
    alone, loaded = _stream(point, arm, "alone"), _stream(point, arm, "with a save")
    if alone is None or loaded is None:
        return None
    return _ratio(worst_save_gap(loaded), p99(gaps_ms(alone.times)))


def rss_growth(point: SizePoint) -> tuple[int, int] | None:
    if not point.rss:
        return None
    start = point.rss[0].rss
    return start, max(s.rss for s in point.rss) - start


def big_saves(point: SizePoint) -> list[LoggedSave]:
    """kvproxy's saves of a state at least half the returning conversation's size."""
    state = _state(point)
    return [s for s in point.saves if s.bytes >= state / 2] if state else point.saves


def markdown(result: BigResult) -> str:
    pts = result.points
    parts = [
        "Returning conversation, evicted by others first: time to first token",
        _returning(pts),
        "Restore against the disk's own read of the same file (kvproxy ÷ disk: read time ÷ "
        "restore time; the server alone restores its own save of the same size)",
        _restores(pts),
        "What kvproxy adds to the server alone (its restore call, then the request)",
        _added(pts),
        "Saves against the disk's write of the same size",
        _saves(pts),
        "A token stream on one slot while a big state is saved on another (gaps in ms)",
        _streams(pts),
        "kvproxy's memory (VmRSS, sampled every 0.25 s through its arm)",
        _rss(pts),
        "SIGTERM right after every slot got a new turn, then a restart",
        _shutdown(pts),
        "Disk kept for the returning conversation after its five turns",
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
    return f"{_t(r.ttft_s)} ({r.cached:,} cached)" if cached else _t(r.ttft_s)


def _returning(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        again = p.find(DIRECT_NO_CACHE, "re-prefill")
        rate = again.tokens / (again.prompt_ms / 1000) if again and again.prompt_ms else None
        rows.append(
            [
                _tokens(p),
                gib(_state(p)) if _state(p) else None,
                _ttft(again),
                _ttft(p.find(DIRECT_RAM_CACHE, "returning"), cached=True),
                _ttft(p.find(KVPROXY, "cold"), cached=True),
                _ttft(p.find(KVPROXY, "warm"), cached=True),
                _x(speedup(p)),
                None if rate is None else f"{rate:.0f}",
            ]
        )
    cols = [
        "tokens",
        "state",
        "no cache (re-prefill)",
        "server's RAM cache",
        "kvproxy, cold file",
        "kvproxy, warm file",
        "re-prefill ÷ kvproxy cold",
        "prefill tok/s",
    ]
    return table(cols, rows)


def _restores(pts: list[SizePoint]) -> str:
    rows: list[list[object]] = []
    for p in pts:
        row: list[object] = [_tokens(p)]
        for what, read_of in (("cold", "cold_read_s"), ("warm", "warm_read_s")):
            r, server = p.find(KVPROXY, what), _action(p, f"restore {what}")
            size = r.state_bytes if r is not None else 0
            read = getattr(r, read_of) if r is not None else None
            restore = r.restore_ms / 1000 if r is not None and r.cache_state == "restored" else None
            row += [
                gib(size) if size else None,
                f"{_t(read)}, {_rate(size, read)}" if read else None,
                f"{_t(server.server_ms / 1000)}, {_rate(server.bytes, server.server_ms / 1000)}"
                if server and server.server_ms
                else None,
                f"{_t(restore)}, {_rate(size, restore)}" if restore else None,
                _x(restore_vs_disk(p, what)),
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
        ]
    return table(cols, rows)


def _added(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        for what in ("cold", "warm"):
            r, alone = p.find(KVPROXY, what), server_alone(p, what)
            if r is None:
                continue
            added = r.ttft_s - alone if alone and r.ttft_s else None
            rows.append(
                [
                    _tokens(p),
                    what,
                    _t(alone),
                    _t(r.ttfb_s),
                    _t(r.ttft_s),
                    None if added is None else f"{added:+.2f} s",
                    "; ".join(r.waited) or "nothing logged",
                ]
            )
    cols = [
        "tokens",
        "file",
        "server alone: restore + request",
        "kvproxy: first byte",
        "first token",
        "added",
        "meanwhile (kvproxy's log)",
    ]
    return table(cols, rows)


def _saves(pts: list[SizePoint]) -> str:
    rows = []
    for p in pts:
        server, disk, saves = _action(p, "save"), p.disk, big_saves(p)
        median = statistics.median(s.ms for s in saves) / 1000 if saves else None
        canonical = statistics.median(s.canonical_ms for s in saves) / 1000 if saves else None
        size = statistics.median(s.bytes for s in saves) if saves else 0
        background = sum(s.background for s in saves)
        rows.append(
            [
                _tokens(p),
                gib(server.bytes) if server else None,
                f"{_t(server.server_ms / 1000)}, {_rate(server.bytes, server.server_ms / 1000)}"
                if server
                else None,
                f"{len(saves)} ({len(saves) - background} on a path, {background} background)",
                f"{_t(median)}, {_rate(size, median)}" if median else None,
                _t(canonical),
                f"{_t(disk.write_s)}, {_rate(disk.bytes, disk.write_s)}" if disk else None,
                f"{_t(disk.total_s)}, {_rate(disk.bytes, disk.total_s)}" if disk else None,
                _x(_ratio(median, disk.total_s)) if disk else None,
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
            alone, loaded = _stream(p, arm, "alone"), _stream(p, arm, "with a save")
            if alone is None or loaded is None:
                continue
            worst = worst_save_gap(loaded)
            saves = [w for w in loaded.windows if w.what == "save"]
            counts = (
                ", ".join(f"{v} {k}" for k, v in loaded.counts.items())
                if loaded.counts
                else f"{len(saves)} save (the server's own)"
            )
            rows.append(
                [
                    _tokens(p),
                    arm,
                    _gaps(alone.times),
                    _gaps(loaded.times),
                    None if worst is None else f"{worst:.0f}",
                    _x(gap_ratio(p, arm)),
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
                _tokens(p),
                gib(_state(p)) if _state(p) else None,
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
        s = p.shutdown
        if s is None:
            continue
        back = sum(r.cache_state == "restored" for r in s.back)
        rows.append(
            [
                _tokens(p),
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
                _tokens(p),
                k.turns,
                k.files,
                gib(k.bytes),
                gib(k.newest_bytes),
                _x(_ratio(k.bytes, k.newest_bytes)),
                f"{k.dir_files} files, {gib(k.dir_bytes)}",
            ]
        )
    cols = ["tokens", "turns", "its files", "on disk", "newest state", "÷ newest", "cache dir"]
    return table(cols, rows)


def checks(result: BigResult) -> list[Check]:
    """The "Done when" figures of the issue, per size."""
    out = []
    for p in result.points:
        n = f"{_tokens(p):,} tokens"
        x = speedup(p)
        out.append(
            Check(
                f"big: returning TTFT ≥ {TTFT_TARGET:.0f}× faster than re-prefill (at 8k), {n}",
                _x(x) or "—",
                None if x is None or p.size < TTFT_TARGET_AT else x >= TTFT_TARGET,
            )
        )
        for what in ("cold", "warm"):
            v = restore_vs_disk(p, what)
            out.append(
                Check(
                    f"big: restore ≥ {RESTORE_TARGET}× the disk's read ({what}), {n}",
                    _x(v) or "—",
                    None if v is None else v >= RESTORE_TARGET,
                )
            )
        g = gap_ratio(p)
        out.append(
            Check(
                f"big: a save's longest token gap ≤ {GAP_TARGET:.0f}× the undisturbed p99, {n}",
                _x(g) or "— (no save fell in the stream)",
                None if g is None else g <= GAP_TARGET,
            )
        )
        growth = rss_growth(p)
        out.append(
            Check(
                f"big: kvproxy's RSS flat (grows < {RSS_FLAT_BYTES // 1024**2} MiB), {n}",
                "—" if growth is None else f"{growth[1] / 1024**2:+.0f} MiB",
                None if growth is None else growth[1] < RSS_FLAT_BYTES,
            )
        )
        s = p.shutdown
        if s is not None:
            back = sum(r.cache_state == "restored" for r in s.back)
            met = s.seconds <= SHUTDOWN_TARGET_S and not s.lost and back == len(s.back)
            out.append(
                Check(
                    f"big: SIGTERM within {SHUTDOWN_TARGET_S:.0f} s, nothing lost (4 × 1 GiB), {n}",
                    f"{s.held_slots} × {gib(s.held_bytes / max(s.held_slots, 1))}: "
                    f"{s.seconds:.1f} s, {back}/{len(s.back)} restored",
                    met,
                )
            )
        k = p.kept
        if k is not None:
            ratio = _ratio(k.bytes, k.newest_bytes)
            out.append(
                Check(
                    f"big: {k.turns} turns keep ≤ {KEPT_TARGET}× the newest state, {n}",
                    _x(ratio) or "—",
                    None if ratio is None else ratio <= KEPT_TARGET,
                )
            )
    return out


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
        ("kvproxy, cold file", KVPROXY, "cold", "tab:blue"),
        ("kvproxy, warm file", KVPROXY, "warm", "tab:cyan"),
    ]
    width = 0.8 / len(bars)
    labels = [f"{_tokens(p):,}\n{gib(_state(p))}" for p in pts]
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
