"""Setting values as people write them in flags, env vars and the config file: durations
(`90`, `90s`, `15m`), comma lists, route patterns, server addresses."""

from __future__ import annotations

import posixpath
import re
from typing import Annotated

from pydantic import BeforeValidator, Field

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h|d|w)?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(value: object) -> object:
    """Accept `90`, `90s`, `15m`, `12h`, `3d`; anything else is left for pydantic to reject."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if match:
            return float(match.group(1)) * _UNIT_SECONDS[(match.group(2) or "s").lower()]
    return value


Duration = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]


def comma_list(value: object, lower: bool = False) -> object:
    """`a, b,,c` → `["a", "b", "c"]`; a list is left as it is."""
    if isinstance(value, str):
        items = [v.strip() for v in value.split(",") if v.strip()]
        return [v.lower() for v in items] if lower else items
    return value


def server_addresses(value: object) -> object:
    """One address or several (a list, or comma lists), each without a trailing /v1: kvproxy
    adds /v1 itself, and users paste the server's OpenAI base URL."""
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        return value
    urls = [u.strip() for item in items for u in str(item).split(",") if u.strip()]
    return [re.sub(r"/v1/*$", "", u.rstrip("/")) for u in urls]


def route_patterns(value: object) -> object:
    """Paths (`/props`) and trees (`/admin/*`), normalised; a pattern not starting with / is
    an error."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        return value
    routes: list[str] = []
    for item in items:
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            if not part.startswith("/"):
                raise ValueError(f"{part!r} is not a path (it must start with /)")
            under = part.endswith("/*")
            norm = posixpath.normpath(part.removesuffix("/*") or "/")
            norm = "/" + norm.lstrip("/")
            routes.append(norm.rstrip("/") + "/*" if under else norm)
    return routes
