"""`chaos`: a bounded mixed workload through kvproxy in front of a real llama-server, with
SIGKILLs of either process, then an audit of what is left.

The workload: `clients` concurrent clients, `tenants` API keys, conversations speaking chat
(whole, streamed, hung up mid-stream), Anthropic Messages (whole and streamed) and Responses,
plus raw `/completion` calls, `/metrics` scrapes and cross-tenant probes (a key never seen
before sending another tenant's conversation byte for byte). Faults are spread evenly over the
run: kvproxy (sidecar mode, restarted on the same port and cache dir) or llama-server
(restarted on the same port) killed with SIGKILL at a random moment of whatever is in flight.
Every request has a time bound; a request that reaches it is stuck.

At the end kvproxy stops (SIGTERM: it saves every slot), the server is killed and restarted
(its slots empty), kvproxy starts again, and every conversation sends one more turn, which
kvproxy should restore from disk. kvproxy stops, the cache dir is audited, and each of those
turns is sent straight to the server, every slot erased first: the answers must be the same.

Decisions live in chaos_plan.py, the wire in chaos_wire.py, the audit in chaos_audit.py,
the records in chaos_records.py, the checks and tables in chaos_report.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from kvproxy.keys import shared_prefix
from kvproxy.server.managed import ManagedServer, free_port, server_command
from kvproxy_bench.arms import BenchEnv, ProxyArm
from kvproxy_bench.chaos_audit import audit
from kvproxy_bench.chaos_disk import DiskRecord, TinyDisk
from kvproxy_bench.chaos_plan import (
    BROKEN,
    Fault,
    Kind,
    Outcome,
    Wire,
    cross_tenant,
    fault_due,
    fault_plan,
    parts_at_a_tie,
    side_request,
    turn_kind,
    wire_of,
)
from kvproxy_bench.chaos_records import (
    ChaosOptions,
    ChaosResult,
    FaultRecord,
    FinalRecord,
    ProbeRecord,
)
from kvproxy_bench.chaos_slow import Slowloris
from kvproxy_bench.chaos_tenants import TimingPair, renumbered, visible
from kvproxy_bench.chaos_wire import Sent, route_body, send
from kvproxy_bench.client import Client
from kvproxy_bench.dialogues import first_turn, question
from kvproxy_bench.report import progress


@dataclass
class Convo:
    id: int  # its project number, in its system prompt
    tenant: int
    wire: Wire
    history: list[dict[str, Any]]  # system, then user/assistant pairs that were answered
    turns: int = 0
    busy: bool = False

    @property
    def key(self) -> str:
        return f"chaos-tenant-{self.tenant}"

    def next_messages(self) -> list[dict[str, Any]]:
        if self.turns == 0:
            return [*self.history, first_turn(self.id)[1]]
        return [*self.history, {"role": "user", "content": question(self.turns + 1)}]


class SidecarProxy(ProxyArm):
    """`kvproxy serve --upstream URL` on a fixed port and cache dir, so that a restart after a
    SIGKILL is the same proxy to its clients and finds what the killed one left on disk."""

    def __init__(self, env: BenchEnv, rig: Rig, opts: ChaosOptions) -> None:
        super().__init__(env, opts.slots, opts.ctx_per_slot, list(opts.proxy_args))
        self.rig = rig
        self.cache_dir = rig.cache_dir
        self.log_path = env.workdir / "kvproxy.log"
        self.proc.log_path = self.log_path

    def command(self, port: int) -> list[str]:
        # Sidecar mode: the server is the rig's, killed and restarted on its own.
        return [
            sys.executable,
            "-m",
            "kvproxy.cli",
            "serve",
            *(arg for url in self.rig.server_urls for arg in ("--upstream", url)),
            "--cache-dir",
            str(self.cache_dir),
            "--port",
            str(port),
            *self.proxy_args,
        ]

    async def start(self) -> None:
        await self.proc.start(self.command(self.rig.proxy_port))
        self.url = f"http://127.0.0.1:{self.rig.proxy_port}"
        await self.ready()

    async def ready(self) -> None:
        """Serving with its cache on; while the disk is full, serving at all: a kvproxy
        started then cannot open its cache dir until the disk has room (it keeps trying), and
        passes requests through meanwhile."""
        deadline = time.monotonic() + self.env.start_timeout
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            while time.monotonic() < deadline:
                if self.proc.exited is not None:
                    raise RuntimeError(f"kvproxy exited with {self.proc.exited}")
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                    async with session.get(self.url + "/kvproxy/stats") as resp:
                        if resp.status == 200:
                            enabled = (await resp.json()).get("enabled")
                            if enabled or self.rig.disk_full:
                                return
                await asyncio.sleep(0.2)
        raise RuntimeError(f"kvproxy not ready after {self.env.start_timeout:g}s")


class Rig:
    """The two processes, each killed and started again on the same port and cache dir."""

    def __init__(self, env: BenchEnv, opts: ChaosOptions, cache_dir: Path | None = None) -> None:
        self.env = env
        self.opts = opts
        self.cache_dir = cache_dir or env.new_dir("chaos-cache")
        self.server_ports: list[int] = []
        while len(self.server_ports) < opts.servers:
            port = free_port()
            if port not in self.server_ports:
                self.server_ports.append(port)
        self.proxy_port = free_port(avoid=self.server_ports[0])
        self.server_urls = [f"http://127.0.0.1:{port}" for port in self.server_ports]
        # The first server: the reference answers and direct probes go there.
        self.server_url = self.server_urls[0]
        self.servers: list[ManagedServer | None] = [None] * opts.servers
        self.server_kills = 0
        self.proxy = SidecarProxy(env, self, opts)
        self.proxy_up = asyncio.Event()  # kvproxy answers
        self.disk_full = False  # the cache dir's filesystem is full (chaos_disk.py)
        self.proxy_kills = 0
        self.all_up = asyncio.Event()  # and so does the server behind it

    @property
    def server(self) -> ManagedServer | None:
        return self.servers[0]

    async def start_server(self, which: int | None = None) -> None:
        """Start one server (`which`), or every one."""
        for i in range(len(self.servers)) if which is None else (which,):
            cmd = server_command(
                self.env.binary,
                self.env.model,
                self.server_ports[i],
                self.cache_dir,
                self.opts.slots,
                self.opts.ctx_per_slot,
                None,
                [*self.env.common_flags(), "--cache-ram", "0"],
            )
            log_path = self.env.workdir / ("server.log" if i == 0 else f"server{i}.log")
            server = ManagedServer(cmd, self.server_ports[i], log_path=log_path)
            self.servers[i] = server
            await server.start(self.env.start_timeout)

    async def kill_server(self) -> int:
        """SIGKILL the next server in turn; which one it was."""
        which = self.server_kills % len(self.servers)
        self.server_kills += 1
        server = self.servers[which]
        proc = server.process if server is not None else None
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            await proc.wait()
        return which

    async def start(self) -> None:
        await asyncio.to_thread(self.cache_dir.mkdir, 0o700, True, True)
        await self.start_server()
        await self.proxy.start()
        self.proxy_up.set()
        self.all_up.set()

    async def inject(self, fault: Fault) -> None:
        """Kill one process with SIGKILL and start it again; returns once both serve."""
        self.all_up.clear()
        if fault is Fault.KILL_PROXY:
            self.proxy_up.clear()
            self.proxy_kills += 1
            await self.proxy.proc.kill()
            await self.proxy.start()
            self.proxy_up.set()
        else:
            await self.start_server(await self.kill_server())
            await self.proxy.ready()
        self.all_up.set()

    async def stop(self) -> None:
        await self.proxy.stop()
        for server in self.servers:
            if server is not None:
                await server.stop()


class Chaos:
    def __init__(self, env: BenchEnv, opts: ChaosOptions) -> None:
        self.env = env
        self.opts = opts
        self.disk: TinyDisk | None = None
        cache_dir, skipped = None, ""
        if opts.full_disk:
            disk = TinyDisk(env.workdir / "chaos-disk", opts.disk_mib)
            why = disk.setup()
            if why is None:
                self.disk, cache_dir = disk, disk.cache_dir
                # kvproxy alone keeps the disk well short of full: only the filler fills it.
                opts.proxy_args = (*opts.proxy_args, "--max-disk", f"{opts.disk_mib // 2}MiB")
            else:
                skipped = why
                progress(f"chaos: no full disk: {why}")
        self.result = ChaosResult(options=asdict(opts), disk_skipped=skipped)
        self.rig = Rig(env, opts, cache_dir)
        self.disk_done = self.disk is None
        self.freed_at = 0.0  # time.time() the filler went
        self.slowloris: Slowloris | None = None
        self.convos = [
            Convo(1000 + c, c % opts.tenants, wire_of(c), first_turn(1000 + c, opts.n_facts)[:1])
            for c in range(opts.conversations)
        ]
        self.first_tokens: dict[int, list[int]] = {}
        self.probe_keys = 0
        self.ended = 0
        self.answered = 0  # requests answered whole (Outcome.OK), scrapes left out
        self.in_flight = 0
        self.progressed = asyncio.Event()
        self.faults_done = False
        self.started = 0.0
        self.session: aiohttp.ClientSession | None = None

    # --- the run

    async def run(self) -> ChaosResult:
        self.started = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self.session = session
            try:
                await self.rig.start()
                await self._first_tokens()
                await self._slow_clients()
                workers = [asyncio.create_task(self._worker(w)) for w in range(self.opts.clients)]
                if self.disk is not None:
                    workers.append(asyncio.create_task(self._full_disk(self.disk)))
                try:
                    await self._inject_faults()
                    self.faults_done = True
                    await asyncio.gather(*workers)
                finally:
                    for w in workers:
                        w.cancel()
                    await asyncio.gather(*workers, return_exceptions=True)
                await self._stop_slow_clients()
                progress(
                    f"chaos: workload done, {self.ended} requests ({self.answered} answered); "
                    "final turns"
                )
                self.result.proxy_stats = await self.rig.proxy.stats()
                if self.result.disk is not None:
                    self.result.disk.saves_after = await asyncio.to_thread(self._saved_since)
                await self._timing_probes()
                await self._final_turns()
                await self.rig.proxy.stop()
                self.result.audit = await asyncio.to_thread(audit, self.rig.cache_dir)
                await self._direct_answers()
            finally:
                self.faults_done = True
                await self._stop_slow_clients()
                await self.rig.stop()
                if self.disk is not None:
                    await asyncio.to_thread(self.disk.teardown)
        self.result.wall_s = time.monotonic() - self.started
        return self.result

    def _finished(self) -> bool:
        over = time.monotonic() - self.started > self.opts.duration
        done = self.faults_done and self.disk_done
        return over or (done and self.answered >= self.opts.requests)

    async def _until(self, answered: int) -> None:
        """Returns once `answered` requests were answered whole (or the run is over)."""
        while self.answered < answered and not self._finished():
            self.progressed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.progressed.wait(), 1.0)

    async def _inject_faults(self) -> None:
        rng = random.Random(f"{self.opts.seed}-faults")
        plan = fault_plan(rng, self.opts.faults)
        for i, fault in enumerate(plan):
            await self._until(fault_due(i, len(plan), self.opts.requests))
            if self._finished():
                return
            await asyncio.sleep(rng.uniform(0.0, 1.5))  # a random moment of what is in flight
            at, in_flight = time.monotonic() - self.started, self.in_flight
            progress(f"chaos: fault {i + 1}/{len(plan)}: {fault} ({in_flight} in flight)")
            await self.rig.inject(fault)
            down = time.monotonic() - self.started - at
            self.result.faults.append(FaultRecord(fault.value, at, down, in_flight))

    async def _slow_clients(self) -> None:
        """Other clients' latency without slow clients, then with them (they stay on through
        the workload)."""
        effect = self.result.slow_effect
        if self.opts.latency_requests:
            effect.without = await self._latencies()
        if not self.opts.slow_clients:
            return
        self.slowloris = Slowloris(
            lambda: ("127.0.0.1", self.rig.proxy_port),
            self.opts.slow_clients,
            self.opts.slow_interval,
            self.rig.proxy_up,
        )
        self.slowloris.start()
        effect.held = await self.slowloris.held(self.opts.slow_clients, 30.0)
        progress(f"chaos: {effect.held} slow connections open")
        if self.opts.latency_requests:
            effect.with_slow = await self._latencies()

    async def _stop_slow_clients(self) -> None:
        if self.slowloris is not None:
            await self.slowloris.stop()
            self.result.slow = self.slowloris.stats
            self.slowloris = None

    async def _latencies(self) -> dict[str, list[float]]:
        """One client's requests one after another: a short chat turn (resident after the
        first) and a /tokenize call (a pass-through route), each timed whole."""
        messages = first_turn(999, 2)
        chat_path, chat = route_body(Wire.CHAT, messages, self.opts.max_tokens)
        tokenize = {"content": str(messages[0]["content"])}
        out: dict[str, list[float]] = {"chat": [], "/tokenize": []}
        for _ in range(self.opts.latency_requests):
            kinds = (("chat", chat_path, chat), ("/tokenize", "/tokenize", tokenize))
            for kind, path, body in kinds:
                started = time.monotonic()
                wire = Wire.CHAT if kind == "chat" else None
                sent = await self._request(Kind.CHAT, wire, path, body, "chaos-latency")
                if sent.outcome is Outcome.OK or (wire is None and sent.status == 200):
                    out[kind].append(time.monotonic() - started)
        return out

    async def _full_disk(self, disk: TinyDisk) -> None:
        """Fills the cache dir's filesystem for `full_for` requests, then frees it."""
        record = self.result.disk = DiskRecord(self.opts.disk_mib)
        try:
            await self._until(int(self.opts.requests * 0.3))
            if time.monotonic() - self.started > self.opts.duration:
                return
            with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
                record.saves_before = int((await self.rig.proxy.stats()).get("saves", 0))
            record.filled_at_s = time.monotonic() - self.started
            self.rig.disk_full = True
            record.filler_mib = await asyncio.to_thread(disk.fill) / 2**20
            full_since, ended_since = self.answered, self.ended
            kills_before = self.rig.proxy_kills
            progress(f"chaos: the cache disk is full ({record.filler_mib:.0f} MiB of filler)")
            await self._until(full_since + self.opts.full_for)
            with contextlib.suppress(aiohttp.ClientError, OSError, ValueError):
                stats = await self.rig.proxy.stats()
                record.faults_seen = ", ".join(sorted(stats.get("faults") or {}))
                saves = int(stats.get("saves", 0)) - record.saves_before
                restarted = self.rig.proxy_kills != kills_before
                record.saves_while_full = None if restarted else saves
            record.requests_while_full = self.ended - ended_since
        finally:
            await asyncio.to_thread(disk.free)
            self.rig.disk_full = False
            self.freed_at = time.time()
            record.freed_at_s = time.monotonic() - self.started
            self.disk_done = True
            progress("chaos: the cache disk is free again")

    def _saved_since(self) -> int:
        """State files written after the disk was freed (kvproxy's counters restart with it)."""
        root = self.rig.cache_dir
        return sum(
            1 for p in root.glob("*.kv") if self.freed_at and p.stat().st_mtime >= self.freed_at
        )

    async def _timing_probes(self) -> None:
        """Pairs of requests from new keys: another tenant's conversation byte for byte, and
        the same with its project renumbered (see chaos_tenants.py)."""
        answered = [c for c in self.convos if c.turns > 0]
        # Caching again after the last fault: a request kvproxy passes through uncached while
        # it does not know the server's slots (a server just restarted) runs where the server
        # puts it, as without kvproxy; the probes are about what kvproxy's cache tells.
        await self.rig.proxy.ready()
        for i in range(self.opts.timing_pairs if answered else 0):
            convo = answered[i % len(answered)]
            same = convo.next_messages()
            pair = {"same": same, "control": renumbered(same, convo.id, 9000 + i)}
            seen: dict[str, tuple[float, dict[str, str]]] = {}
            for which in ("same", "control") if i % 2 == 0 else ("control", "same"):
                path, body = route_body(Wire.CHAT, pair[which], self.opts.max_tokens)
                self.probe_keys += 1
                started = time.monotonic()
                sent = await self._request(
                    Kind.PROBE, Wire.CHAT, path, body, f"chaos-probe-{self.probe_keys}"
                )
                if sent.outcome is not Outcome.OK:
                    break
                shown = {**visible(sent.headers), "cache_n": str(sent.cache_n)}
                seen[which] = (time.monotonic() - started, shown)
            if len(seen) == 2:
                self.result.timing.pairs.append(
                    TimingPair(
                        convo.id,
                        seen["same"][0],
                        seen["control"][0],
                        seen["same"][1],
                        seen["control"][1],
                    )
                )

    async def _worker(self, n: int) -> None:
        rng = random.Random(f"{self.opts.seed}-client-{n}")
        while not self._finished():
            await self.rig.proxy_up.wait()
            kind = side_request(rng)
            if kind is Kind.PROBE:
                sent = await self._probe(rng)
            elif kind is not None:
                sent = await self._side(kind, rng)
            else:
                sent = await self._turn(rng)
            if sent is None:
                await asyncio.sleep(0.05)  # every conversation is busy or done
                continue
            kind, reply = sent
            if reply.outcome in BROKEN:
                self.result.details.append(f"{kind}: {reply.outcome}: {reply.detail}")
            self.result.tally.add(kind, reply.outcome)
            self.ended += 1
            # Scrapes are answered at once whatever else is going on: they are not the work.
            self.answered += reply.outcome is Outcome.OK and kind is not Kind.METRICS
            self.progressed.set()
            if reply.outcome not in (Outcome.OK, Outcome.HUNG_UP):
                await self.rig.all_up.wait()  # a fault: go on once it is over

    async def _request(
        self,
        kind: Kind,
        wire: Wire | None,
        path: str,
        body: dict[str, Any] | None,
        key: str | None,
        url: str | None = None,
    ) -> Sent:
        assert self.session is not None
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        self.in_flight += 1
        try:
            return await send(
                self.session,
                (url or self.rig.proxy.url) + path,
                kind,
                wire,
                body,
                headers,
                self.opts.stuck_after,
            )
        finally:
            self.in_flight -= 1

    async def _turn(self, rng: random.Random) -> tuple[Kind, Sent] | None:
        free = [c for c in self.convos if not c.busy and c.turns < self.opts.max_turns]
        if not free:
            return None
        convo = rng.choice(free)
        kind = turn_kind(rng, convo.wire)
        messages = convo.next_messages()
        stream = kind in (Kind.CHAT_STREAM, Kind.HANG_UP, Kind.MESSAGES_STREAM)
        path, body = route_body(convo.wire, messages, self.opts.max_tokens, stream)
        convo.busy = True
        try:
            sent = await self._request(kind, convo.wire, path, body, convo.key)
        finally:
            convo.busy = False
        if sent.outcome is Outcome.OK and sent.text is not None:
            convo.history = [*messages, {"role": "assistant", "content": sent.text}]
            convo.turns += 1
        return kind, sent

    async def _side(self, kind: Kind, rng: random.Random) -> tuple[Kind, Sent]:
        if kind is Kind.METRICS:
            return kind, await self._request(kind, None, "/metrics", None, None)
        body = {
            "prompt": f"The {rng.choice(('red', 'quiet', 'ancient'))} river of project",
            "n_predict": self.opts.max_tokens,
            "temperature": 0,
        }
        key = f"chaos-tenant-{rng.randrange(self.opts.tenants)}"
        return kind, await self._request(kind, None, "/completion", body, key)

    async def _probe(self, rng: random.Random) -> tuple[Kind, Sent] | None:
        """A new tenant sends another tenant's next turn byte for byte, as chat."""
        answered = [c for c in self.convos if c.turns > 0]
        if not answered:
            return None
        convo = rng.choice(answered)
        messages = convo.next_messages()
        path, body = route_body(Wire.CHAT, messages, self.opts.max_tokens)
        self.probe_keys += 1  # a key never seen before: no state of its own anywhere
        key = f"chaos-probe-{self.probe_keys}"
        sent = await self._request(Kind.PROBE, Wire.CHAT, path, body, key)
        if sent.outcome is Outcome.OK:
            allowed = await self._allowed(convo, messages)
            if allowed is not None:
                crossed = cross_tenant(sent.cache_state, sent.cache_n, allowed)
                self.result.probes.append(
                    ProbeRecord(convo.id, sent.cache_state, sent.cache_n, allowed, crossed)
                )
        return Kind.PROBE, sent

    async def _tokens(self, messages: list[dict[str, Any]]) -> list[int] | None:
        """The prompt the server evaluates for `messages`, asked of the server itself."""
        assert self.session is not None
        for _ in range(3):
            await self.rig.all_up.wait()
            with contextlib.suppress(aiohttp.ClientError, OSError, KeyError):
                return await Client(self.session).prompt_tokens(self.rig.server_url, messages)
            await asyncio.sleep(0.5)
        return None

    async def _first_tokens(self) -> None:
        for c in self.convos:
            tokens = await self._tokens(c.next_messages())
            self.first_tokens[c.id] = tokens or []

    async def _allowed(self, convo: Convo, messages: list[dict[str, Any]]) -> int | None:
        """The most of the probe's prompt any other conversation's prompt shares."""
        tokens = await self._tokens(messages)
        if tokens is None:
            return None
        return max(shared_prefix(tokens, t) for c, t in self.first_tokens.items() if c != convo.id)

    # --- the end

    async def _final_turns(self) -> None:
        """Both processes restarted (kvproxy saving every slot first): every conversation's
        next turn must come from disk."""
        await self.rig.proxy.stop()
        for _ in self.rig.servers:
            await self.rig.kill_server()
        await self.rig.start_server()
        await self.rig.proxy.start()
        for convo in self.convos:
            if convo.turns == 0:
                continue
            path, body = route_body(convo.wire, convo.next_messages(), self.opts.max_tokens)
            kind = {Wire.CHAT: Kind.CHAT, Wire.MESSAGES: Kind.MESSAGES}.get(
                convo.wire, Kind.RESPONSES
            )
            sent = await self._request(kind, convo.wire, path, body, convo.key)
            self.result.final.append(
                FinalRecord(
                    convo.id,
                    convo.wire.value,
                    sent.cache_state,
                    int(sent.headers.get("X-KVProxy-Restored-Tokens") or 0),
                    sent.text if sent.outcome is Outcome.OK else None,
                    None,
                )
            )

    async def _direct_answers(self) -> None:
        """The same turns straight to the server, from an empty slot each."""
        assert self.session is not None
        by_id = {c.id: c for c in self.convos}
        for record in self.result.final:
            convo = by_id[record.conversation]
            for slot in range(self.opts.slots):
                url = f"{self.rig.server_url}/slots/{slot}?action=erase"
                async with self.session.post(url) as resp:
                    resp.raise_for_status()
            path, body = route_body(convo.wire, convo.next_messages(), self.opts.max_tokens)
            sent = await self._request(
                Kind.CHAT, convo.wire, path, body, None, url=self.rig.server_url
            )
            record.direct = sent.text if sent.outcome is Outcome.OK else None
            if record.direct is not None and record.proxied is not None and not record.same:
                record.tie = await self._tie(convo, record.proxied, record.direct)
                self.result.details.append(
                    f"conversation {record.conversation} ({record.wire}, {record.cache_state}): "
                    f"kvproxy {record.proxied!r}, the server alone {record.direct!r}"
                    + ("" if record.tie is None else f" (its top two {record.tie:.4f} nats apart)")
                )

    async def _tie(self, convo: Convo, proxied: str, direct: str) -> float | None:
        """The server alone's top two where the answers part, from an empty slot again."""
        assert self.session is not None
        for slot in range(self.opts.slots):
            async with self.session.post(f"{self.rig.server_url}/slots/{slot}?action=erase"):
                pass
        path, body = route_body(Wire.CHAT, convo.next_messages(), self.opts.max_tokens)
        body |= {"logprobs": True, "top_logprobs": 2}
        async with self.session.post(self.rig.server_url + path, json=body) as resp:
            reply = await resp.json()
        tokens = []
        try:
            for t in reply["choices"][0]["logprobs"]["content"]:
                tops = [float(x["logprob"]) for x in t["top_logprobs"]]
                tokens.append((bytes(t["bytes"]), tops[0], tops[1] if len(tops) > 1 else None))
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        return parts_at_a_tie(tokens, proxied, direct)


async def run_chaos(env: BenchEnv, opts: ChaosOptions) -> ChaosResult:
    progress(
        f"chaos: {opts.requests}+ requests, {opts.faults} faults, {opts.clients} clients, "
        f"{opts.tenants} tenants, {opts.conversations} conversations, seed {opts.seed}"
    )
    return await Chaos(env, opts).run()
