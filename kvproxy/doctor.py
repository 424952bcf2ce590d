"""`kvproxy doctor`: checks a running llama-server and cache dir for what kvproxy needs."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("doctor", help="check a llama-server and cache dir (not yet built)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    raise SystemExit("kvproxy doctor: not built yet")
