"""`kvproxy doctor`'s flags. The checks (`kvproxy.doctor`) talk to llama-server through
aiohttp, imported only when the command runs: `kvproxy ls` and the rest do not pay for it."""

from __future__ import annotations

import argparse

from .flags import add_settings_flags


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "doctor",
        help="check a running llama-server and the cache dir for what kvproxy needs",
        description=(
            "Checks a running llama-server and cache dir for what kvproxy needs. Each check "
            "is ok, warn or fail, with the exact flag to change; any fail exits 1. Without "
            "--quick, two probes use idle slots (a running kvproxy notices and re-reads "
            "them): whether an idle slot keeps its tokens when another slot works, and "
            "whether the server reuses a restored state — the one thing that decides if "
            "restores save any time on this model."
        ),
    )
    add_settings_flags(parser, only=("upstream", "upstream_api_key", "cache_dir", "max_disk"))
    parser.add_argument("--quick", action="store_true", help="skip the probes that use slots")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .doctor import run as doctor

    return doctor(args)
