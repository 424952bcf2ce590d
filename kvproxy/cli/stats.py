"""`kvproxy stats`: what a running proxy reports (GET /kvproxy/stats), readable."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from typing import Any

import orjson

from kvproxy import readable
from kvproxy.cli.display import entries_
from kvproxy.cli.flags import settings_from_args
from kvproxy.config import Settings


def cmd_stats(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    url = (args.url or _own_url(settings)).rstrip("/")
    request = urllib.request.Request(url + "/kvproxy/stats", headers={"Accept": "application/json"})
    if settings.admin_token is not None:
        request.add_header("Authorization", f"Bearer {settings.admin_token.get_secret_value()}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            return _fail(f"{url} needs its admin token (--admin-token or KVPROXY_ADMIN_TOKEN)")
        return _fail(f"{url}/kvproxy/stats answered HTTP {exc.code}: is this a kvproxy?")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        return _fail(f"no kvproxy answering at {url} ({reason}); is `kvproxy serve` running?")
    try:
        stats = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return _fail(f"{url}/kvproxy/stats did not answer JSON: is this a kvproxy?")
    if args.json:
        print(orjson.dumps(stats, option=orjson.OPT_INDENT_2).decode())
    else:
        print(render_stats(stats, url))
    return 0


def _own_url(settings: Settings) -> str:
    host = settings.hosts[0]
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"  # listening everywhere: loopback reaches it
    elif host == "::":
        host = "::1"
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def render_stats(s: dict[str, Any], url: str) -> str:
    """A readable table of `/kvproxy/stats`; tolerant of missing fields (older proxies)."""
    req = s.get("requests") or {}
    hist = s.get("histograms") or {}
    cached, prefilled = int(s.get("tokens_cached", 0)), int(s.get("tokens_prefilled", 0))
    share = f" ({100 * cached / (cached + prefilled):.1f}%)" if cached + prefilled else ""

    def ms(name: str, q: str = "p50") -> str:
        value = (hist.get(name) or {}).get(q)
        return "-" if value is None else readable.duration(value)

    def on(flag: Any) -> str:
        return "on" if flag else "OFF"

    rows = [
        ["proxy", f"{url}: caching {on(s.get('enabled'))}, disk {on(s.get('disk_enabled'))}"],
        [
            "requests",
            "  ".join(f"{d} {req.get(d, 0):,}" for d in ("resident", "restored", "miss", "bypass")),
        ],
        ["tokens", f"from cache {cached:,}{share}, prefilled {prefilled:,}"],
        [
            "prefill time",
            f"saved ≈ {_seconds(s.get('prefill_seconds_saved'))}, "
            f"spent {readable.duration(s.get('prefill_seconds', 0))}",
        ],
        [
            "saves",
            f"{s.get('saves', 0):,} ok ({s.get('background_saves', 0):,} in the background), "
            f"{s.get('save_failures', 0):,} failed, "
            f"{readable.size(int(s.get('saved_bytes', 0)))}, p50 {ms('save_seconds')}",
        ],
        [
            "restores",
            f"{s.get('restores', 0):,} ok, {s.get('restore_failures', 0):,} failed, "
            f"{s.get('restored_tokens', 0):,} tokens, p50 {ms('restore_seconds')}, "
            f"{s.get('ineffective_restores', 0):,} not reused by the server, "
            f"{s.get('prefills_over_restores', 0):,} prefilled instead (cheaper than the read)",
        ],
        [
            "queue",
            f"{s.get('queue_waiting', 0)} waiting, wait p50 {ms('queue_wait_seconds')}, "
            f"p90 {ms('queue_wait_seconds', 'p90')}",
        ],
        [
            "disk",
            f"{entries_(s.get('entries', 0))}, {readable.size(int(s.get('disk_bytes', 0)))}, "
            f"{s.get('evictions', 0):,} evicted",
        ],
        [
            "misses",
            f"{s.get('miss_explained', 0):,} explained (see the log), "
            f"{s.get('slot_resets_seen', 0):,} slot resets seen",
        ],
    ]
    lines = [f"{name:<13}{text}" for name, text in rows]
    backends = s.get("backends") or []
    several = len(backends) > 1
    for backend in backends if several else []:
        state = "down: " + str(backend["down"]) if backend.get("down") else "in rotation"
        lines.append(f"server       {backend.get('name')}  {state}")
    if not several and backends and backends[0].get("model"):
        lines.append(f"model        {backends[0]['model']}")
    lines.append("slots")
    for slot in s.get("slots") or []:
        key = slot.get("key")
        held = f"{key[:12]}  {slot.get('n_tokens', 0):,} tokens" if key else "empty"
        state = "busy" if slot.get("busy") else "idle"
        saved = "  saved" if key and slot.get("saved") else ("  unsaved" if key else "")
        where = f"{slot.get('backend')} " if several else ""
        lines.append(f"  {where}{slot.get('id')}  {state:<5} {held}{saved}")
    return "\n".join(lines)


# --- helpers


def _fail(message: str, code: int = 1) -> int:
    print(f"kvproxy: {message}", file=sys.stderr)
    return code


def _seconds(value: Any) -> str:
    """A number of seconds, or "—" when there is none yet (no cold prefill measured)."""
    return "—" if value is None else readable.duration(value)
