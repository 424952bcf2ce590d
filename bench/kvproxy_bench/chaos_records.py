"""The records of a `chaos` run (chaos.py): its options, what each fault, probe and final
turn came to, and the result they make, with its verdict (chaos_plan.py) and its JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kvproxy_bench.chaos_audit import Audit
from kvproxy_bench.chaos_disk import DiskRecord
from kvproxy_bench.chaos_plan import Outcome, Tally, Verdict
from kvproxy_bench.chaos_slow import SlowEffect, SlowStats
from kvproxy_bench.chaos_tenants import TimingProbes


@dataclass
class ChaosOptions:
    seed: int = 1
    # Requests answered whole (200; /metrics scrapes left out), at least; the run also goes
    # on until every fault is in.
    # Faults are spread over these, so work gets done between two faults however many
    # requests a fault cuts off.
    requests: int = 80
    faults: int = 10
    duration: float = 900.0  # hard bound on the workload, seconds
    clients: int = 4
    tenants: int = 4
    conversations: int = 8
    slots: int = 2
    ctx_per_slot: int = 2048
    n_facts: int = 10  # ~250-token system prompts
    max_tokens: int = 8
    max_turns: int = 6
    stuck_after: float = 120.0  # a request with no answer this long is stuck
    # A request waiting for a slot gets its 503 (--queue-timeout) well before it would count
    # as stuck, however many clients queue up.
    proxy_args: tuple[str, ...] = ("--min-tokens", "64", "--queue-timeout", "60s")
    # Slow clients (chaos_slow.py): connections trickling heads and bodies all through the
    # workload; other clients' latency measured first without them, then with them.
    slow_clients: int = 0
    slow_interval: float = 1.0  # seconds between two trickled pieces
    latency_requests: int = 0  # per request kind and phase; 0: no latency phases
    # A full disk (chaos_disk.py): the cache dir on a tmpfs of `disk_mib`, filled once
    # `requests` × 0.3 requests were answered and freed `full_for` answered requests later.
    full_disk: bool = False
    disk_mib: int = 1024
    full_for: int = 20
    # llama-servers behind the one kvproxy (sharing its cache dir); a server fault kills one
    # of them in turn, with requests in flight on it and the others serving.
    servers: int = 1
    timing_pairs: int = 0  # cross-tenant timing probes after the workload (chaos_tenants.py)


@dataclass
class FaultRecord:
    fault: str
    at_s: float
    down_s: float
    in_flight: int


@dataclass
class ProbeRecord:
    conversation: int
    cache_state: str
    cache_n: int
    allowed: int
    crossed: bool


@dataclass
class FinalRecord:
    conversation: int
    wire: str
    cache_state: str
    restored_tokens: int
    proxied: str | None
    direct: str | None
    # Where the answers part, the margin of the server's own top two if within TIE_NATS.
    tie: float | None = None

    @property
    def same(self) -> bool:
        return self.proxied is not None and self.proxied == self.direct


@dataclass
class ChaosResult:
    options: dict[str, Any]
    tally: Tally = field(default_factory=Tally)
    faults: list[FaultRecord] = field(default_factory=list)
    probes: list[ProbeRecord] = field(default_factory=list)
    final: list[FinalRecord] = field(default_factory=list)
    audit: Audit = field(default_factory=Audit)
    proxy_stats: dict[str, Any] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)  # what the broken requests said
    wall_s: float = 0.0
    slow: SlowStats | None = None
    slow_effect: SlowEffect = field(default_factory=SlowEffect)
    disk: DiskRecord | None = None
    disk_skipped: str = ""  # why the full disk asked for did not run
    timing: TimingProbes = field(default_factory=TimingProbes)

    def verdict(self) -> Verdict:
        compared = [f for f in self.final if f.proxied is not None and f.direct is not None]
        return Verdict(
            kvproxy_500s=self.tally.total(Outcome.KVPROXY_500),
            stuck=self.tally.total(Outcome.STUCK),
            invalid_entries=len(self.audit.invalid),
            answers_differing=sum(not f.same and f.tie is None for f in compared),
            cross_tenant_reads=sum(p.crossed for p in self.probes),
            faults_injected=len(self.faults),
            faults_wanted=int(self.options["faults"]),
            restored_checked=sum(f.cache_state == "restored" for f in compared),
            probes=len(self.probes),
            disk_wanted=bool(self.options.get("full_disk")),
            disk_ran=self.disk is not None and self.disk.filler_mib > 0,
            disk_resumed=self.disk is not None and self.disk.saves_after > 0,
            timing_wanted=bool(self.options.get("timing_pairs")),
            timing_pairs=len(self.timing.pairs),
            timing_differing=self.timing.differing(),
            timing_seen=tuple(p.told() for p in self.timing.pairs if p.differ),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "requests": [
                {"kind": k, "outcome": o, "count": n} for (k, o), n in self.tally.counts.items()
            ],
            "faults": [asdict(f) for f in self.faults],
            "probes": [asdict(p) for p in self.probes],
            "final": [{**asdict(f), "same": f.same} for f in self.final],
            "audit": asdict(self.audit),
            "proxy_stats": self.proxy_stats,
            "slow": None if self.slow is None else asdict(self.slow),
            "slow_effect": asdict(self.slow_effect),
            "disk": None if self.disk is None else asdict(self.disk),
            "disk_skipped": self.disk_skipped,
            "timing": asdict(self.timing),
            "violations": self.verdict().violations(),
            "wall_s": self.wall_s,
        }
