"""`kvproxy ls|rm|gc|stats`: what the cache dir holds, and what a running proxy reports."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    del sub  # not built yet
