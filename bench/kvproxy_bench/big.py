"""`big`: kvproxy at the state sizes of the models people run — 128 KiB of KV a token on the
8B-geometry model (kvproxy_bench.ggufmodels), so a 2k / 8k / 16k-token conversation is a
256 MiB / 1 GiB / 2 GiB state — side by side with llama-server alone, per size, on fresh
servers of `slots` slots each:

- **direct, RAM cache** (the server's default `--cache-ram`): conversation A (the size), then
  `slots` others (`others_tokens`, at most the size) take every slot, then A comes back;
- **kvproxy** (managed mode, `--cache-ram 0` behind it), RSS sampled all along: the same; A
  comes back with every state file dropped from the page cache (cold), then, after the others
  came back too, once more (warm: its newest state was just written); a stream on one slot,
  alone and while another conversation is restored and saved on the other slot; SIGTERM right
  after each slot got a new turn (unsaved states), a restart, and every one of them again;
  then the bytes A's five turns keep on disk;
- **direct, no cache** (`--cache-ram 0`): kvproxy's returning request with `cache_prompt:
  false` (the re-prefill), then with another question (resident); the server's own save of
  that slot, its restore into the other slot cold and warm, a request after it; a stream alone
  and while the server saves the other slot (`POST /slots/0?action=save`).

Beside them, the disk alone: the state file read cold (after `fsync` and
`posix_fadvise(DONTNEED)`) and warm, and a plain write of the same size, then its `fsync`.
Time to first token (TTFT) is a streamed request's first event; the reply's head is its first
byte (TTFB). Tables and the issue's targets: big_report.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from kvproxy_bench.arms import DIRECT_RAM_CACHE, KVPROXY, Arm, BenchEnv, DirectArm, ProxyArm
from kvproxy_bench.big_disk import disk_write, drop_from_page_cache, read_times
from kvproxy_bench.big_proxied import Proxied
from kvproxy_bench.big_records import (
    BIG_ARM_FLAGS,
    BIG_ARMS,
    A,
    Action,
    BigOptions,
    BigResult,
    SizePoint,
    StreamRun,
)
from kvproxy_bench.big_stream import Window
from kvproxy_bench.big_talk import Sized, Talk, first_or_done
from kvproxy_bench.client import Client
from kvproxy_bench.report import progress

__all__ = ["BIG_ARMS", "BIG_ARM_FLAGS", "BigOptions", "BigResult", "make_big_arm", "run_big"]

SERVER_FILE = "big-state.kv"  # the server alone's own save (the direct, no-cache arm)

ArmMaker = Callable[[str, BenchEnv, int, int, BigOptions], Arm]


def make_big_arm(name: str, env: BenchEnv, slots: int, ctx: int, opts: BigOptions) -> Arm:
    if name == KVPROXY:
        return ProxyArm(env, slots, ctx, ["--min-tokens", str(opts.kvproxy_min_tokens)])
    arm = DirectArm(env, slots, ctx, ram_cache=name == DIRECT_RAM_CACHE)
    arm.log_path = arm.cache_dir.parent / f"{arm.cache_dir.name}.log"  # kept with --keep
    return arm


async def run_big(env: BenchEnv, opts: BigOptions, make_arm: ArmMaker = make_big_arm) -> BigResult:
    result = BigResult(options=asdict(opts))
    client = Client()
    try:
        for size in opts.sizes:
            point = SizePoint(size, opts.others(size), opts.slots)
            result.points.append(point)
            run = _Direct(client, opts, point)
            for name in opts.arms:
                arm = make_arm(name, env, opts.slots, opts.ctx_per_slot(size), opts)
                progress(f"big {size:,}: {name}")
                try:
                    async with arm:
                        await run.sized(arm.url)
                        if name == KVPROXY:
                            assert isinstance(arm, ProxyArm)
                            await Proxied(run, arm).steps()
                        elif name == DIRECT_RAM_CACHE:
                            await run.ram_cache(arm)
                        else:
                            await run.no_cache(arm)
                except Exception as exc:  # one arm's failure must not lose an hour's run
                    point.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                    progress(f"  {name} failed: {type(exc).__name__}: {exc}")
    finally:
        await client.close()
    return result


class _Direct(Sized):
    """The server alone: with its RAM cache, and without a cache (its own save and restore
    of the same state, beside the disk's read and write)."""

    async def ram_cache(self, arm: Arm) -> None:
        talk = Talk(self.convs)
        for conv in [A, *self.others]:
            await self.turn(arm.url, talk, conv, arm=arm.name)
        self.returning.setdefault(arm.name, talk.next[A])
        await self.ask(arm.name, "returning", arm.url, talk.next[A])

    async def no_cache(self, arm: Arm) -> None:
        talk = Talk(self.convs)
        # kvproxy's returning request, so the two are the same prompt.
        messages = self.returning.get(KVPROXY) or next(iter(self.returning.values()), None)
        if messages is None:  # run alone: its own first turn
            await self.turn(arm.url, talk, A)
            messages = talk.next[A]
        talk.next[A] = messages
        url = arm.url
        # Each measured request is a new turn after the slot's last reply, as kvproxy's
        # returns are: the re-prefill, then resident, then after the server's own restore.
        again, got = await self.ask(
            arm.name, "re-prefill", url, messages, id_slot=0, cache_prompt=False
        )
        if again.prompt_ms:
            self.point.prefill_rates["re-prefill"] = again.tokens / again.prompt_ms * 1000
        talk.heard(A, got.content)
        _, got = await self.ask(arm.name, "resident", url, talk.next[A], id_slot=0)
        talk.heard(A, got.content)
        saved, wall = await self._action(url, 0, "save")
        n, size = int(saved.get("n_saved", 0)), int(saved.get("n_written", 0))
        self.point.actions.append(Action("save", n, size, _ms(saved, "save_ms"), wall))
        self.point.bytes_per_token = size / n if n else 0.0
        path = arm.cache_dir / SERVER_FILE
        size, cold, warm = await asyncio.to_thread(read_times, path)
        if self.point.disk is None:
            self.point.disk = await asyncio.to_thread(disk_write, arm.cache_dir, size)
        await asyncio.to_thread(drop_from_page_cache, path)
        for what in ("restore cold", "restore warm"):
            got_, wall = await self._action(url, 1, "restore")
            n = int(got_.get("n_restored", 0))
            self.point.actions.append(Action(what, n, size, _ms(got_, "restore_ms"), wall))
            if what == "restore cold":
                after, _ = await self.ask(
                    arm.name, "after its restore", url, talk.next[A], id_slot=1
                )
                after.restore_ms, after.state_bytes = wall * 1000, size
                after.cold_read_s, after.warm_read_s = cold, warm
        await self._streams(arm)

    async def _action(self, url: str, slot: int, action: str) -> tuple[dict[str, Any], float]:
        started = time.perf_counter()
        got = await self.client.post_json(
            f"{url}/slots/{slot}?action={action}", {"filename": SERVER_FILE}
        )
        return dict(got), time.perf_counter() - started

    async def _streams(self, arm: Arm) -> None:
        """Slot 1 streams; the second time the server saves slot 0 (A) meanwhile."""
        alone = await self.story(arm.url, 1, id_slot=1)
        self.point.streams.append(StreamRun(arm.name, "alone", alone.times, error=alone.error))
        first = asyncio.Event()
        task = asyncio.ensure_future(self.story(arm.url, 2, first, id_slot=1))
        await first_or_done(first, task)
        await asyncio.sleep(0.3)
        started = time.perf_counter()
        saved, wall = await self._action(arm.url, 0, "save")
        window = Window("save", started, time.perf_counter())
        n, size = int(saved.get("n_saved", 0)), int(saved.get("n_written", 0))
        what = "save during a stream"
        self.point.actions.append(Action(what, n, size, _ms(saved, "save_ms"), wall))
        loaded = await task
        run = StreamRun(arm.name, "with a save", loaded.times, [window], error=loaded.error)
        self.point.streams.append(run)


def _ms(reply: dict[str, Any], key: str) -> float:
    return float((reply.get("timings") or {}).get(key, 0.0))
