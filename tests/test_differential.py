"""The differential run's fast subset: files of llama.cpp's own server test suite, chosen by
measurement to run in a few minutes, pass through kvproxy (and with --min-tokens 0) as they
do straight to llama-server, but for the reviewed intended blocks. The full run is
`make differential` (docs/differential.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parent.parent

# Files (and one test) chosen by measurement (docs/differential.md has the per-file times): a
# few minutes for the three arms on 2 cores; they cover the six transparency bugs of issue 24.
FAST_SUBSET = (
    "unit/test_basic.py",  # --host as a comma list, /slots, the UI paths
    "unit/test_chat_completion.py::test_return_progress",  # the prompt cache after start-up
    "unit/test_ignore_eos.py",
    "unit/test_metrics.py",  # kvproxy's own /metrics, /slots refused: the intended blocks
    "unit/test_proxy.py",  # /cors-proxy: refused by kvproxy (intended), the others pass
    "unit/test_security.py",  # --api-key, X-Api-Key, CORS preflight, static assets
    "unit/test_sleep.py",  # --sleep-idle-seconds: kvproxy must not wake the server
    "unit/test_tokenize.py",
)


@pytest.mark.timeout(900)
def test_server_suite_subset_passes_through_kvproxy(tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "differential.py"), "--work", str(tmp_path),
         "--json", str(summary), *FAST_SUBSET],
        capture_output=True,
        text=True,
        timeout=850,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    data = json.loads(summary.read_text())
    direct = data["arms"]["direct"]["counts"]
    assert direct.get("passed", 0) > 0, out[-3000:]
    for arm in ("kvproxy", "kvproxy-min0"):
        assert data["blocks"][arm]["unexpected"] == [], out[-6000:]
