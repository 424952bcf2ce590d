"""Settings as command-line flags: one flag per Settings field, so flags, env vars and docs
never drift apart. Every subcommand that takes settings builds its flags here."""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from kvproxy.config import Settings


def _is_bool(annotation: Any) -> bool:
    if annotation is bool:
        return True
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return bool in typing.get_args(annotation)
    return False


def _default_shown(default: object) -> str:
    """`; default X` for a plain default (none for factories, secrets and empty ones)."""
    if default is None or default == "" or type(default).__name__ == "PydanticUndefinedType":
        return ""
    if isinstance(default, bool | int | float | str):
        return f"; default {default}"
    return ""


def add_settings_flags(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """One flag per Settings field, so flags, env vars and docs never drift apart."""
    for name, info in Settings.model_fields.items():
        if name == "server_args" or (only is not None and name not in only):
            continue
        flag = "--" + name.replace("_", "-")
        env = f"KVPROXY_{name.upper()}"
        shown = _default_shown(info.default)
        help_text = f"{info.description} [env {env}{shown}]"
        if _is_bool(info.annotation):
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        elif isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get("repeatable"):
            parser.add_argument(
                flag,
                dest=name,
                action="append",
                default=argparse.SUPPRESS,
                metavar=name.upper(),
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=name, default=argparse.SUPPRESS, metavar=name.upper(), help=help_text
            )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the Settings-field flags present in `args` (plus env vars)."""
    cli = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return load_settings(cli)


def load_settings(cli: dict[str, Any]) -> Settings:
    """Flags win over env vars; an invalid value is one clear line, not a traceback."""
    try:
        return Settings(**cli)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if not err["loc"]:  # settings that do not go together (Settings._one_mode)
                problems.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            field = str(err["loc"][0])
            where = f"--{field.replace('_', '-')} / KVPROXY_{field.upper()}"
            problems.append(f"{where}: {err['msg']} (got {err.get('input')!r})")
        raise SystemExit(f"kvproxy: invalid setting: {'; '.join(problems)}") from None
