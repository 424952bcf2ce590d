"""Settings as command-line flags: one flag per Settings field, so flags, env vars and docs
never drift apart. Every subcommand that takes settings builds its flags here."""

from __future__ import annotations

import argparse
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvproxy.config import Settings, settings_with_file


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


def add_settings_flags(
    parser: argparse.ArgumentParser,
    only: Sequence[str] | None = None,
    meaning: Mapping[str, str] | None = None,
) -> None:
    """One flag per Settings field, so flags, env vars and docs never drift apart. `meaning`:
    what a flag means to a command that reads it otherwise than `serve` does (`kvproxy stats`
    asks the proxy at --host and --port, it listens on neither)."""
    for name, info in Settings.model_fields.items():
        if name == "server_args" or (only is not None and name not in only):
            continue
        flag = "--" + name.replace("_", "-")
        env = f"KVPROXY_{name.upper()}"
        shown = _default_shown(info.default)
        described = (meaning or {}).get(name, info.description)
        help_text = f"{described} [env {env}{shown}]"
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


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE.toml",
        help="read settings from this TOML file (keys: the flags' names with underscores, "
        'e.g. cache_dir = "/var/cache/kvproxy"); flags and KVPROXY_* env vars win over it',
    )


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from the Settings-field flags present in `args` (plus env vars, and the
    --config file when the command takes one)."""
    cli = {k: v for k, v in vars(args).items() if k in Settings.model_fields}
    return load_settings(cli, getattr(args, "config", None))


def _file_keys(config: Path) -> set[str]:
    """The file's top-level keys; a missing or malformed file is one clear line."""
    try:
        with open(config, "rb") as f:
            return set(tomllib.load(f))
    except FileNotFoundError:
        raise SystemExit(f"kvproxy: --config {config}: no such file") from None
    except OSError as exc:
        raise SystemExit(f"kvproxy: --config {config}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SystemExit(f"kvproxy: --config {config}: not valid TOML: {exc}") from None


def load_settings(cli: dict[str, Any], config: Path | None = None) -> Settings:
    """Flags win over env vars, env vars over the config file; an invalid value is one clear
    line, not a traceback."""
    in_file = _file_keys(config) if config is not None else set()
    try:
        if config is None:
            return Settings(**cli)
        return settings_with_file(config)(**cli)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if not err["loc"]:  # settings that do not go together (Settings._one_mode)
                problems.append(str(err["msg"]).removeprefix("Value error, "))
                continue
            field = str(err["loc"][0])
            if err["type"] == "extra_forbidden":  # only the file can name an unknown setting
                spelled = field.replace("-", "_")
                hint = f" (write it {spelled})" if spelled in Settings.model_fields else ""
                problems.append(f"{config}: unknown setting {field!r}{hint}")
                continue
            where = f"--{field.replace('_', '-')} / KVPROXY_{field.upper()}"
            if field in in_file:
                where += f" / {field} in {config}"
            problems.append(f"{where}: {plain(err)} (got {err.get('input')!r})")
        raise SystemExit(f"kvproxy: invalid setting: {'; '.join(problems)}") from None


# What a value must be, by pydantic's error type: kvproxy's words, naming an example.
_MUST = {
    "url_parsing": "must be a URL with its scheme, such as http://127.0.0.1:8080",
    "url_scheme": "must be an http:// or https:// URL",
    "int_parsing": "must be a whole number",
    "int_from_float": "must be a whole number",
    "float_parsing": "must be a number, or a duration such as 90s, 15m, 12h or 3d",
    "byte_size_unit": "must be a size such as 512MiB, 50GiB or 0",
    "byte_size": "must be a size such as 512MiB, 50GiB or 0",
    "bool_parsing": "must be true or false (on/off, yes/no, 1/0)",
}


def plain(err: Any) -> str:
    """A value's problem in one short phrase, without pydantic's own vocabulary."""
    kind, ctx = err.get("type", ""), err.get("ctx") or {}
    if kind in _MUST:
        return _MUST[kind]
    if kind == "greater_than_equal":
        return f"must be at least {ctx.get('ge')}"
    if kind == "less_than_equal":
        return f"must be at most {ctx.get('le')}"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}"
    return str(err.get("msg", "invalid")).removeprefix("Value error, ")
