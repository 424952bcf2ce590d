"""`kvproxy ls|rm|gc|stats`: what the cache dir holds, and what a running proxy reports.

`ls`, `rm` and `gc` work on the cache dir's index (`index.sqlite3`) directly and are safe
while a proxy uses it: they never sweep (which could delete a save in flight), they query
the index rather than load it (`ls --limit 20` reads 20 rows), and they delete entries the
way the proxy does, row first. The proxy's next query no longer finds a removed entry, and
a restore already under way finds its state file gone and answers the request as a miss.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import time
from typing import Any

import orjson
from pydantic import ByteSize, TypeAdapter

from kvproxy import readable
from kvproxy.cli.display import Progress, entries_, human_age, table
from kvproxy.cli.flags import add_settings_flags, settings_from_args
from kvproxy.cli.stats import cmd_stats
from kvproxy.config import Settings
from kvproxy.settingvalues import parse_duration
from kvproxy.store import SORTS, Entry, Listing, Store

MIN_PREFIX = 6
BATCH = 1000  # rows removed per transaction


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    ls = sub.add_parser(
        "ls",
        help="list the cache dir's entries",
        description="List cached conversations: key prefix, tokens, size on disk, age, "
        "last use, restores (hits), messages and model. Read-only; safe while a proxy runs.",
    )
    ls.add_argument("--sort", choices=sorted(SORTS), default="last-used", help="sort order")
    ls.add_argument("--reverse", action="store_true", help="reverse the sort order")
    ls.add_argument("--limit", type=int, metavar="N", help="show at most N entries")
    ls.add_argument("--min-size", metavar="SIZE", help="only entries of at least SIZE (10MiB)")
    ls.add_argument(
        "--older-than", metavar="AGE", help="only entries created at least AGE ago (2h, 3d)"
    )
    ls.add_argument("--unused-for", metavar="AGE", help="only entries last used at least AGE ago")
    ls.add_argument("--json", action="store_true", help="print a JSON array")
    add_settings_flags(ls, only=["cache_dir"])
    ls.set_defaults(func=cmd_ls)

    rm = sub.add_parser(
        "rm",
        help="remove cache entries",
        description="Remove entries by key prefix (at least 6 hex characters, as `kvproxy ls` "
        "shows them), or all of them. Safe while a proxy runs: it treats them as misses.",
    )
    rm.add_argument("keys", nargs="*", metavar="KEY", help="key prefix of an entry")
    rm.add_argument("--all", action="store_true", help="remove every entry")
    add_settings_flags(rm, only=["cache_dir"])
    rm.set_defaults(func=cmd_rm)

    gc = sub.add_parser(
        "gc",
        help="apply the TTL and the byte budget now",
        description="Evict entries unused for longer than --ttl, then the least recently "
        "used ones until the cache fits --max-disk, as a running proxy's housekeeping does.",
    )
    gc.add_argument("--dry-run", action="store_true", help="only say what would be evicted")
    add_settings_flags(gc, only=["cache_dir", "ttl", "max_disk"])
    gc.set_defaults(func=cmd_gc)

    stats = sub.add_parser(
        "stats",
        help="show a running proxy's statistics",
        description="Read GET /kvproxy/stats of a running proxy and print it as a table.",
    )
    stats.add_argument("--url", help="the proxy's URL (default: from --host and --port)")
    stats.add_argument("--json", action="store_true", help="print the raw JSON")
    add_settings_flags(
        stats,
        only=["host", "port", "admin_token"],
        meaning={
            "host": "address of the kvproxy to ask (the --host it was started with)",
            "port": "port of the kvproxy to ask (the --port it was started with)",
        },
    )
    stats.set_defaults(func=cmd_stats)


# --- ls


def cmd_ls(args: argparse.Namespace) -> int:
    settings = _settings(args)
    store, code = _open(settings)
    if store is None:
        return code
    now = time.time()
    try:
        min_size = _size(args.min_size, "--min-size")
        older = _duration(args.older_than, "--older-than")
        unused = _duration(args.unused_for, "--unused-for")
    except ValueError as exc:
        return _fail(str(exc))
    query = Listing(
        sort=args.sort,
        reverse=args.reverse,
        limit=args.limit,
        min_size=min_size,
        created_before=now - older if older is not None else float("inf"),
        used_before=now - unused if unused is not None else float("inf"),
    )
    shown, selected = store.listing(query)
    # Only the rows shown are checked (a few lstats each): a damaged one is named, not listed.
    damaged = [(e.key, why) for e in shown if (why := store.files.check_state_file(e)) is not None]
    if damaged:
        print(
            f"{len(damaged)} damaged {entries_(len(damaged), counted=False)} not shown (a "
            "restore drops them, as does `kvproxy rm`): "
            + "; ".join(f"{k[:12]}: {why}" for k, why in damaged[:5]),
            file=sys.stderr,
        )
        bad = {k for k, _ in damaged}
        shown = [e for e in shown if e.key not in bad]
    if args.json:
        print(
            orjson.dumps([_entry_json(e, now) for e in shown], option=orjson.OPT_INDENT_2).decode()
        )
        return 0
    rows = [
        [
            e.key[:12],
            f"{e.n_tokens:,}",
            readable.size(e.on_disk),
            human_age(now - e.created),
            human_age(now - e.last_used) + " ago",
            str(e.hits),
            str(e.n_messages),
            e.model or "-",  # saved before kvproxy recorded it
        ]
        for e in shown
    ]
    if rows:
        columns = ["KEY", "TOKENS", "SIZE", "AGE", "LAST USED", "HITS", "MSGS", "MODEL"]
        table(columns, rows, {1, 2, 5, 6})
    more = f" (showing {len(shown)})" if len(shown) < selected.entries else ""
    print(
        f"{entries_(selected.entries)}{more}, {readable.size(selected.bytes)} in "
        f"{settings.cache_dir} (all: {store.summary.entries}, {readable.size(store.total_bytes)}; "
        f"budget {_budget(settings)}, ttl {human_age(settings.ttl) if settings.ttl else 'none'})"
    )
    return 0


def _entry_json(e: Entry, now: float) -> dict[str, Any]:
    return {
        "key": e.key,
        "model": e.model or None,
        "namespace": e.namespace,
        "tokens": e.n_tokens,
        "bytes": e.on_disk,
        "state_bytes": e.state_bytes,
        "text_bytes": e.msgs_bytes,
        "messages": e.n_messages,
        "hits": e.hits,
        "created": e.created,
        "last_used": e.last_used,
        "age_s": round(now - e.created, 3),
        "idle_s": round(now - e.last_used, 3),
    }


# --- rm


def cmd_rm(args: argparse.Namespace) -> int:
    if args.all == bool(args.keys):
        return _fail("give one or more KEY prefixes, or --all", 2)
    settings = _settings(args)
    store, code = _open(settings, quiet=args.all)
    if store is None:
        return code
    if args.all:
        victims = store.all_entries()
        damaged = [key for key, _ in store.problems]
    else:
        victims, damaged = [], []
        for prefix in args.keys:
            found = _match(store, prefix)
            if isinstance(found, str):
                return _fail(found)  # nothing is removed unless every key is clear
            if found not in victims:
                victims.append(found)
    if not victims and not damaged:
        print(f"nothing to remove in {settings.cache_dir}")
        return 0
    with Progress("removing", len(victims)) as progress:
        # Rows in batches (one transaction each), then their files.
        for i in range(0, len(victims), BATCH):
            for entry in store.remove_many(victims[i : i + BATCH]):
                if len(victims) <= 20:
                    print(
                        f"removed {entry.key[:12]} ({entry.n_tokens:,} tokens, "
                        f"{readable.size(entry.on_disk)})"
                    )
                progress.step()
    for key in damaged:
        store.remove_damaged(key)
    freed = sum(e.on_disk for e in victims)
    extra = f" and {len(damaged)} damaged" if damaged else ""
    print(f"removed {entries_(len(victims))}{extra}, {readable.size(freed)} freed")
    return 0


def _match(store: Store, prefix: str) -> Entry | str:
    """The one entry whose key starts with `prefix`, or what is wrong with it."""
    prefix = prefix.lower()
    if len(prefix) < MIN_PREFIX or any(c not in "0123456789abcdef" for c in prefix):
        return f"{prefix!r}: a key prefix is at least {MIN_PREFIX} hex characters (see kvproxy ls)"
    matches = store.with_prefix(prefix)
    if not matches:
        return f"{prefix}: no entry with this key prefix in {store.root}"
    if len(matches) > 1:
        listed = ", ".join(sorted(e.key for e in matches))
        return f"{prefix}: ambiguous, {len(matches)} entries match: {listed}"
    return matches[0]


# --- gc


def cmd_gc(args: argparse.Namespace) -> int:
    settings = _settings(args)
    store, code = _open(settings)
    if store is None:
        return code
    now = time.time()
    before_n, before_bytes = store.summary.entries, store.total_bytes
    victims = store.select_victims(now, dry_run=args.dry_run)
    freed = sum(e.on_disk for e in victims)
    by_ttl = sum(1 for e in victims if store.expired(e, now))
    why = f"{by_ttl} unused for over {human_age(store.ttl)}, {len(victims) - by_ttl} over budget"
    if args.dry_run:
        for entry in victims[:20]:
            print(
                f"would evict {entry.key[:12]} ({readable.size(entry.on_disk)}, "
                f"last used {human_age(now - entry.last_used)} ago)"
            )
        if len(victims) > 20:
            print(f"… and {len(victims) - 20} more")
        print(
            f"would evict {len(victims)} of {before_n} entries ({why}), "
            f"freeing {readable.size(freed)} of {readable.size(before_bytes)}"
        )
        return 0
    with Progress("evicting", len(victims)) as progress:
        for entry in victims:  # their rows went in one transaction; now their files
            store.delete_files([entry])
            progress.step()
    print(
        f"evicted {len(victims)} of {before_n} entries ({why}), freed {readable.size(freed)}; "
        f"{entries_(store.summary.entries)}, {readable.size(store.total_bytes)} left "
        f"(budget {_budget(settings)})"
    )
    return 0


# --- stats


def _settings(args: argparse.Namespace) -> Settings:
    return settings_from_args(args)


def _open(settings: Settings, quiet: bool = False) -> tuple[Store | None, int]:
    store = Store(settings.cache_dir, settings.ttl, int(settings.max_disk))
    try:
        with Progress("opening", 0) as progress:  # an old cache dir's import, once
            store.open_readonly(progress.report)
    except FileNotFoundError:
        return None, _fail(f"no cache dir at {settings.cache_dir} (set --cache-dir)")
    except (OSError, sqlite3.Error) as exc:
        return None, _fail(f"cannot read {settings.cache_dir}: {exc}")
    if store.problems and not quiet:  # records an import could not take
        print(
            f"skipped {len(store.problems)} damaged "
            f"{entries_(len(store.problems), counted=False)} (a starting proxy drops them): "
            + "; ".join(f"{k[:12]}: {why}" for k, why in store.problems[:5]),
            file=sys.stderr,
        )
    return store, 0


def _duration(value: str | None, flag: str) -> float | None:
    if value is None:
        return None
    seconds = parse_duration(value)
    if not isinstance(seconds, float):
        raise ValueError(f"{flag}: not a duration: {value!r} (try 90s, 15m, 12h, 3d)")
    return seconds


def _size(value: str | None, flag: str) -> int:
    if value is None:
        return 0
    try:
        return int(TypeAdapter(ByteSize).validate_python(value))
    except ValueError:
        raise ValueError(f"{flag}: not a size: {value!r} (try 500MB, 2GiB)") from None


def _budget(settings: Settings) -> str:
    return readable.size(int(settings.max_disk)) if int(settings.max_disk) else "none"


def _fail(message: str, code: int = 1) -> int:
    print(f"kvproxy: {message}", file=sys.stderr)
    return code
