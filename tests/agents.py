"""The real agent clients for the tests: installed by the test set-up itself, the same way
`kvproxy bench agents --install` does (bench/kvproxy_bench/agentclients.py holds the one copy).

`python -m tests.agents` installs every client now.
"""

from __future__ import annotations

import sys

from kvproxy_bench.agentclients import (
    CLAUDE_CODE,
    CODEX,
    NPM_PACKAGES,
    OPENCLAW,
    client_env,
    install,
)

__all__ = ["CLAUDE_CODE", "CODEX", "OPENCLAW", "client_env", "install"]

if __name__ == "__main__":
    for pkg in NPM_PACKAGES:
        print(install(pkg), file=sys.stderr)
