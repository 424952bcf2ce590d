"""The figures of "Big states"' targets, taken from a `kvproxy bench big` run (big.py's
records), and the checks against them — on plain data."""

from __future__ import annotations

from kvproxy_bench.arms import DIRECT_NO_CACHE, KVPROXY
from kvproxy_bench.big_log import LoggedSave, gib
from kvproxy_bench.big_proxied import BUSY
from kvproxy_bench.big_records import Action, BigResult, SizePoint, StreamRun
from kvproxy_bench.big_stream import gaps_in, gaps_ms, p99
from kvproxy_bench.targets import Check

TTFT_TARGET = 100.0  # × faster than re-prefill, at 8k tokens
TTFT_TARGET_AT = 8192
RESTORE_TARGET = 0.9  # × the disk's read of the same file
GAP_TARGET = 2.0  # × the undisturbed p99 gap
RSS_FLAT_BYTES = 64 * 1024**2  # "flat": growth over the run below this
SHUTDOWN_TARGET_S = 30.0
KEPT_TARGET = 1.5  # × the newest state


def fmt_t(seconds: float | None) -> str | None:
    if not seconds:
        return None
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_rate(n_bytes: float, seconds: float | None) -> str | None:
    return f"{n_bytes / seconds / 1e9:.2f} GB/s" if seconds and n_bytes else None


def fmt_x(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}×" if value < 10 else f"{value:.0f}×"


def ratio_of(num: float | None, den: float | None) -> float | None:
    return num / den if num and den else None


def action(point: SizePoint, what: str) -> Action | None:
    return next((a for a in point.actions if a.what == what), None)


def stream_run(point: SizePoint, arm: str, what: str) -> StreamRun | None:
    return next((s for s in point.streams if (s.arm, s.what) == (arm, what)), None)


def tokens_of(point: SizePoint) -> int:
    for arm, what in ((DIRECT_NO_CACHE, "re-prefill"), (KVPROXY, "cold")):
        r = point.find(arm, what)
        if r is not None and r.tokens:
            return r.tokens
    return point.size


def state_of(point: SizePoint) -> int:
    r = point.find(KVPROXY, "cold")
    if r is not None and r.state_bytes:
        return r.state_bytes
    save = action(point, "save")
    return save.bytes if save is not None else 0


def speedup(point: SizePoint, what: str = "cold", arm: str = KVPROXY) -> float | None:
    """Re-prefill TTFT over `arm`'s request `what` (kvproxy's "cold": kvproxy idle, BUSY:
    right after the others' turns; the server alone's "resident": the ceiling, a new turn
    on the slot that still holds the conversation)."""
    again, cold = point.find(DIRECT_NO_CACHE, "re-prefill"), point.find(arm, what)
    return ratio_of(again.ttft_s, cold.ttft_s) if again and cold and not cold.error else None


def restore_vs_disk(point: SizePoint, what: str) -> float | None:
    """Restore throughput over the disk's read of the same file: read time ÷ restore time."""
    r = point.find(KVPROXY, what)
    if r is None or r.cache_state != "restored":
        return None
    read = r.cold_read_s if what == "cold" else r.warm_read_s
    return ratio_of(read, r.restore_ms / 1000)


def server_alone(point: SizePoint, what: str) -> float | None:
    """The server alone restoring the same size and answering: its restore call + TTFT."""
    restore = action(point, f"restore {what}")
    after = point.find(DIRECT_NO_CACHE, "after its restore")
    return restore.wall_s + after.ttft_s if restore and after and after.ttft_s else None


def worst_save_gap(run: StreamRun) -> float | None:
    gaps = gaps_in(run.times, run.windows, "save")
    return max(gaps) if gaps else None


def gap_ratio(point: SizePoint, arm: str = KVPROXY) -> float | None:
    alone, loaded = stream_run(point, arm, "alone"), stream_run(point, arm, "with a save")
    if alone is None or loaded is None:
        return None
    return ratio_of(worst_save_gap(loaded), p99(gaps_ms(alone.times)))


def rss_growth(point: SizePoint) -> tuple[int, int] | None:
    if not point.rss:
        return None
    start = point.rss[0].rss
    return start, max(s.rss for s in point.rss) - start


def big_saves(point: SizePoint) -> list[LoggedSave]:
    """kvproxy's saves of a state at least half the returning conversation's size."""
    state = state_of(point)
    return [s for s in point.saves if s.bytes >= state / 2] if state else point.saves


def checks(result: BigResult) -> list[Check]:
    """The "Done when" figures of the issue, per size."""
    out = []
    for p in result.points:
        n = f"{tokens_of(p):,} tokens"
        for what, when in (("cold", "kvproxy idle"), (BUSY, "right after the others")):
            speed = speedup(p, what)
            out.append(
                Check(
                    f"big: returning TTFT ≥ {TTFT_TARGET:.0f}× faster than re-prefill (at 8k; "
                    f"{when}), {n}",
                    fmt_x(speed) or "—",
                    None if speed is None or p.size < TTFT_TARGET_AT else speed >= TTFT_TARGET,
                )
            )
        for what in ("cold", "warm"):
            v = restore_vs_disk(p, what)
            out.append(
                Check(
                    f"big: restore ≥ {RESTORE_TARGET}× the disk's read ({what}), {n}",
                    fmt_x(v) or "—",
                    None if v is None else v >= RESTORE_TARGET,
                )
            )
        g = gap_ratio(p)
        out.append(
            Check(
                f"big: a save's longest token gap ≤ {GAP_TARGET:.0f}× the undisturbed p99, {n}",
                fmt_x(g) or "— (no save fell in the stream)",
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
        s = p.idle_shutdown
        if s is not None:
            back = sum(r.cache_state == "restored" for r in s.back)
            met = s.seconds <= SHUTDOWN_TARGET_S and not s.lost and back == len(s.back)
            out.append(
                Check(
                    f"big: SIGTERM within {SHUTDOWN_TARGET_S:.0f} s, nothing idle lost "
                    f"(4 × 1 GiB), {n}",
                    f"{s.held_slots} × {gib(s.held_bytes / max(s.held_slots, 1))}: "
                    f"{s.seconds:.1f} s, {back}/{len(s.back)} restored",
                    met,
                )
            )
        s = p.shutdown
        if s is not None:
            out.append(
                Check(
                    f"big: SIGTERM right after new turns stops within {SHUTDOWN_TARGET_S:.0f} s "
                    f"and names what it could not save, {n}",
                    f"{s.held_slots} × {gib(s.held_bytes / max(s.held_slots, 1))}: "
                    f"{s.seconds:.1f} s, {len(s.saves)} saved, {len(s.lost)} named",
                    s.seconds <= SHUTDOWN_TARGET_S
                    and len(s.saves) + len(s.lost) >= s.unsaved_slots,
                )
            )
        k = p.kept
        if k is not None:
            kept = ratio_of(k.bytes, k.newest_bytes)
            out.append(
                Check(
                    f"big: {k.turns} turns keep ≤ {KEPT_TARGET}× the newest state, {n}",
                    fmt_x(kept) or "—",
                    None if kept is None else kept <= KEPT_TARGET,
                )
            )
    return out
