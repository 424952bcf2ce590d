"""`kvproxy doctor`'s flags. The checks (`kvproxy.server.doctor`) talk to llama-server through
aiohttp, imported only when the command runs: `kvproxy ls` and the rest do not pay for it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvproxy.cli.flags import add_config_flag, add_settings_flags, settings_from_args

if TYPE_CHECKING:
    from kvproxy.server.checks import Check


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "doctor",
        help="check a running llama-server and the cache dir for what kvproxy needs",
        description=(
            "Checks a running llama-server and cache dir for what kvproxy needs. Each check "
            "is ok, warn or fail, with the exact flag to change; any fail exits 1. Without "
            "--quick, three probes use idle slots: whether an idle slot keeps its tokens "
            "when another slot works, whether the server reuses a restored state — the one "
            "thing that decides if restores save any time on this model — and whether its "
            "RAM prompt cache is on (with several tenants it must be off: --cache-ram 0). "
            "While a kvproxy serves from the cache dir, they and the probe save are skipped "
            "(its slots hold its conversations): stop it to run them."
        ),
    )
    add_config_flag(parser)  # the server `kvproxy serve --config` names
    add_settings_flags(parser, only=("upstream", "upstream_api_key", "cache_dir", "max_disk"))
    parser.add_argument("--quick", action="store_true", help="skip the probes that use slots")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys
    from dataclasses import asdict

    import orjson

    from kvproxy.server.doctor import diagnose

    settings = settings_from_args(args)
    checks = asyncio.run(diagnose(settings, quick=args.quick))
    if args.json:
        sys.stdout.write(orjson.dumps([asdict(c) for c in checks]).decode() + "\n")
    else:
        print(render(checks))
    return 1 if any(c.status == "fail" for c in checks) else 0


def render(checks: list[Check]) -> str:
    """The checks as a table, each fix under its check."""
    width = max(len(c.name) for c in checks) if checks else 5
    lines = [f"{'check':<{width}}  status  detail"]
    for c in checks:
        lines.append(f"{c.name:<{width}}  {c.status:<6}  {c.detail}")
        if c.fix:
            lines.append(f"{'':<{width}}          fix: {c.fix}")
    return "\n".join(lines)
