"""What each check of `kvproxy doctor` ends in (server/checkup.py runs them, server/doctor.py
over every server): ok, warn or fail, with the exact flag to change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail"]


@dataclass
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


class Stop(Exception):
    """A failed check that makes the later ones meaningless."""
