"""`big`'s kvproxy arm, step by step, with kvproxy's RSS sampled throughout: the others take
every slot from A; A comes back cold right after them (kvproxy still saving them), then,
after the others came back each time and kvproxy is idle, cold and warm; a stream while
another conversation is restored and saved; SIGTERM with every slot holding a new turn, a
restart; the bytes A's five turns keep on disk; every conversation back."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

from kvproxy_bench import big_log
from kvproxy_bench.arms import KVPROXY, ProxyArm
from kvproxy_bench.big_disk import (
    RssSampler,
    disk_write,
    drop_from_page_cache,
    files_of,
    read_times,
    restored_file,
    state_tokens,
)
from kvproxy_bench.big_records import A, Kept, Returning, ShutdownRun, StreamRun
from kvproxy_bench.big_stream import ActionWatch
from kvproxy_bench.big_talk import Sized, Talk, first_or_done
from kvproxy_bench.report import progress
from kvproxy_bench.servers import _saved
from kvproxy_bench.stalls import _counts

NEWCOMER = [{"role": "user", "content": "Hello, a new conversation here."}]
BUSY = "cold, busy"  # A's return right after the others' turns
# How long the idle shutdown waits for kvproxy's idle saves: --idle-save-after, then a GiB
# state's write each, on a slow disk.
IDLE_WAIT_S = 300.0


class Proxied:
    def __init__(self, run: Sized, arm: ProxyArm) -> None:
        self.run, self.arm, self.point = run, arm, run.point
        self.talk = Talk(run.convs)
        proc = arm.proc
        self.rss = RssSampler(lambda: proc.process.pid if proc.process is not None else None)

    async def steps(self) -> None:
        self.rss.start()
        try:
            await self._steps()
        finally:
            await self.rss.stop()
            self.point.rss = self.rss.samples
            span = await asyncio.to_thread(big_log.read_span, self.arm.log_path, 0)
            self.point.saves = span.saves
            if not self.point.bytes_per_token:
                big = max(span.saves, key=lambda s: s.tokens, default=None)
                self.point.bytes_per_token = big.bytes / big.tokens if big else 0.0

    async def _steps(self) -> None:
        run, talk, url = self.run, self.talk, self.arm.url
        self.rss.phase = "fill"
        for conv in [A, *run.others]:
            await run.turn(url, talk, conv, arm=KVPROXY)
        self.rss.phase = "returns"
        # Right after the others' turns, as an agent's next turn comes: kvproxy may still be
        # saving them. Then twice more once kvproxy is idle: cold, and warm.
        await self._return(BUSY, cold=True)
        await self._evict_a()
        run.returning[KVPROXY] = talk.next[A]
        await self._return("cold", cold=True)
        await self._evict_a()
        await self._return("warm", cold=False)
        self.rss.phase = "streams"
        await self._streams(run.others[0])
        convs = [A, *run.others][: run.opts.slots]
        # Once with every slot idle past --idle-save-after (kvproxy saved them: nothing left
        # to write), then right after every slot's new turn (everything left to write).
        for idle in (True, False):
            self.rss.phase = "shutdown"
            out = await self._shutdown(convs, idle)
            self.rss.phase = "after restart"
            await self.arm.start()
            await _cache_open(self.arm)
            if not idle:
                await self._kept()
            await self._back(convs, out)

    async def _evict_a(self) -> None:
        """The others come back, each into the least recently used slot (A's last), and
        kvproxy saves what they leave."""
        for conv in self.run.others:
            await self.run.turn(self.arm.url, self.talk, conv)
        await _saved(self.arm, 0)

    async def _return(self, what: str, cold: bool) -> Returning:
        """A comes back; with `cold`, after every state file left the page cache."""
        cache, log = self.arm.cache_dir, self.arm.log_path
        messages = self.talk.next[A]
        tokens = await self.run.client.prompt_tokens(self.arm.url, messages)
        if cold:
            await asyncio.to_thread(_drop_all, cache)
        start = await asyncio.to_thread(big_log.offset, log)
        out, got = await self.run.ask(KVPROXY, what, self.arm.url, messages)
        span = await asyncio.to_thread(big_log.read_span, log, start)
        out.waited = big_log.describe(span)
        read = None
        if out.cache_state == "restored":
            read = await asyncio.to_thread(_restored_read, cache, tokens)
        if read is not None:
            out.state_bytes, out.cold_read_s, out.warm_read_s = read
            if self.point.disk is None:
                self.point.disk = await asyncio.to_thread(disk_write, cache, out.state_bytes)
        if got.ok:
            self.talk.heard(A, got.content)
        return out

    async def _streams(self, subject: int) -> None:
        """A stream alone, then one during which `subject` is restored on the other slot
        for a turn and saved (in the background, or when a newcomer needs that slot)."""
        run, url = self.run, self.arm.url
        await _saved(self.arm, 0)
        alone = await run.story(url, 1)
        self.point.streams.append(StreamRun(KVPROXY, "alone", alone.times, error=alone.error))
        before = await _counts(self.arm)
        watch = ActionWatch(run.client.session, url)
        watch.start()
        first = asyncio.Event()
        task = asyncio.ensure_future(run.story(url, 2, first))
        await first_or_done(first, task)
        await asyncio.sleep(0.3)
        await run.turn(url, self.talk, subject, max_tokens=1)
        await asyncio.sleep(0.5)
        await run.client.chat(url, NEWCOMER, 1)
        loaded = await task
        windows = await watch.stop()
        after = await _counts(self.arm)
        counts = {k: after[k] - before[k] for k in after}
        self.point.streams.append(
            StreamRun(KVPROXY, "with a save", loaded.times, windows, counts, loaded.error)
        )

    async def _shutdown(self, convs: list[int], idle: bool) -> ShutdownRun:
        """Each slot gets a turn (its state unsaved), then SIGTERM: at once, or with `idle`
        once kvproxy has saved every slot (its idle checkpoint)."""
        run, arm = self.run, self.arm
        out = ShutdownRun()
        await asyncio.gather(*(run.turn(arm.url, self.talk, c) for c in convs))
        if idle:
            began = time.perf_counter()
            await _saved(arm, 0, IDLE_WAIT_S)
            out.idled = time.perf_counter() - began
        per_token = self.point.bytes_per_token or await asyncio.to_thread(_per_token, arm)
        held = [s for s in (await arm.stats())["slots"] if s.get("n_tokens")]
        unsaved = [s for s in held if not s.get("saved")]
        out.held_slots, out.unsaved_slots = len(held), len(unsaved)
        out.held_bytes = int(sum(s["n_tokens"] for s in held) * per_token)
        out.unsaved_bytes = int(sum(s["n_tokens"] for s in unsaved) * per_token)
        start = await asyncio.to_thread(big_log.offset, arm.log_path)
        process = arm.proc.process
        # Recorded once there is a SIGTERM to time.
        if idle:
            self.point.idle_shutdown = out
        else:
            self.point.shutdown = out
        started = time.perf_counter()
        await arm.stop()
        out.seconds = time.perf_counter() - started
        out.exit_code = process.returncode if process is not None else None
        span = await asyncio.to_thread(big_log.read_span, arm.log_path, start)
        out.saves, out.lost = span.saves, span.lost
        when = f"after {out.idled:.0f} s idle" if idle else "at once"
        progress(f"  SIGTERM {when}: {out.seconds:.1f} s, {len(out.saves)} saves, lost: {out.lost}")
        return out

    async def _back(self, convs: list[int], shutdown: ShutdownRun) -> None:
        """After the restart, every conversation SIGTERM found in a slot comes back."""
        for conv in convs:
            what = f"after restart ({conv})"
            back, got = await self.run.ask(KVPROXY, what, self.arm.url, self.talk.next[conv])
            shutdown.back.append(back)
            if got.ok:
                self.talk.heard(conv, got.content)

    async def _kept(self) -> None:
        """A's states on disk after its five turns (the last saved at SIGTERM), against its
        newest."""
        client, url = self.run.client, self.arm.url
        first = await client.prompt_tokens(url, self.run.convs[A])
        tokens = await client.prompt_tokens(url, self.talk.next[A])
        turns = self.talk.turns[A] - 1
        self.point.kept = await asyncio.to_thread(_kept, self.arm, tokens, len(first) // 2, turns)


def _kept(arm: ProxyArm, tokens: list[int], share: int, turns: int) -> Kept:
    mine = files_of(arm.cache_dir, tokens, share)
    every = list(arm.cache_dir.glob("*.kv"))
    newest = max(mine, key=lambda p: p.stat().st_mtime, default=None)
    return Kept(
        turns=turns,
        files=len(mine),
        bytes=sum(p.stat().st_size for p in mine),
        newest_bytes=newest.stat().st_size if newest is not None else 0,
        dir_files=len(every),
        dir_bytes=sum(p.stat().st_size for p in every),
    )


def _per_token(arm: ProxyArm) -> float:
    """Bytes a token, from the largest of kvproxy's state files so far."""
    pairs = [(p.stat().st_size, len(state_tokens(p))) for p in arm.cache_dir.glob("*.kv")]
    size, n = max(pairs, key=lambda x: x[1], default=(0, 0))
    return size / n if n else 0.0


def _drop_all(cache_dir: Path) -> None:
    for path in cache_dir.glob("*.kv"):
        with contextlib.suppress(FileNotFoundError):  # superseded meanwhile
            drop_from_page_cache(path)


def _restored_read(cache_dir: Path, tokens: list[int]) -> tuple[int, float, float] | None:
    """The disk's own reads of the state a restore picked; another look if kvproxy removed it
    meanwhile (a newer state of the same conversation superseding it)."""
    for _ in range(3):
        path = restored_file(cache_dir, tokens)
        if path is None:
            return None
        try:
            return read_times(path)
        except FileNotFoundError:
            continue
    return None


async def _cache_open(arm: ProxyArm, timeout: float = 300.0) -> None:
    """Until a restarted kvproxy has opened its cache dir (it serves uncached before)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (await arm.stats()).get("cache_open", True):
            return
        await asyncio.sleep(0.2)
