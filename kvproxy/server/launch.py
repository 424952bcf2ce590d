"""The llama-server command managed mode runs: one model (`--model`), or a router over a
directory of models (`--models-dir`), with the flags kvproxy needs (managed.py's
server_flags) and those the models need (--swa-full for sliding-window ones)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvproxy.config import Settings
from kvproxy.server.managed import (
    ServerError,
    resolve_model,
    router_command,
    server_command,
)
from kvproxy.server.modelinfo import ModelInfo, read_model_info
from kvproxy.server.serverbin import ServerBinary

log = logging.getLogger("kvproxy.managed")


@dataclass(frozen=True)
class Launch:
    command: list[str]
    sleep_after: float | None  # the server's --sleep-idle-seconds, None: it never sleeps


def gguf_files(models_dir: Path) -> list[Path]:
    """The model files a router finds in `models_dir` (common/preset.cpp
    load_from_models_dir): `*.gguf` at the top and one level down, projector files
    (`mmproj` in the name) left out."""
    found = [*models_dir.glob("*.gguf"), *models_dir.glob("*/*.gguf")]
    return sorted(p for p in found if p.is_file() and "mmproj" not in p.name)


def sleep_idle_seconds(server_args: Sequence[str]) -> float | None:
    """The `--sleep-idle-seconds N` among llama-server's flags (None: it never sleeps)."""
    for i, arg in enumerate(server_args):
        value = None
        if arg == "--sleep-idle-seconds" and i + 1 < len(server_args):
            value = server_args[i + 1]
        elif arg.startswith("--sleep-idle-seconds="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return float(value) if float(value) > 0 else None
            except ValueError:
                return None
    return None


def swa_full(infos: Sequence[ModelInfo], extra: list[str]) -> list[str]:
    """`extra` plus --swa-full when a model has sliding-window layers: without a full-size SWA
    cache the server never reuses a restored state. It costs KV memory (every layer keeps the
    whole context instead of the window); a model without SWA layers ignores it."""
    swa = [info for info in infos if info.has_swa]
    if not swa or "--swa-full" in extra:
        return extra
    log.info("%s is a sliding-window model: adding --swa-full", swa[0].architecture)
    return [*extra, "--swa-full"]


def no_prompt_cache(settings: Settings, extra: list[str]) -> list[str]:
    """`extra` plus `--cache-ram 0` when clients are tenants (--client-api-keys or
    --tenant-header): the server's RAM prompt cache keeps the prompts of every slot it
    reuses and loads the closest one into any slot for any request (server_prompt_cache::
    load), so a tenant's `cache_n` would tell how much of another's prompt it sent, however
    kvproxy clears its slots. kvproxy's disk cache does that cache's work, per tenant."""
    if not settings.tenants:
        return extra
    given = [a for a in extra if a in ("--cache-ram", "-cram") or a.startswith("--cache-ram=")]
    if given:
        log.warning(
            "%s given with several tenants: unless it is 0, a tenant can tell from cache_n "
            "how much of another tenant's prompt it sent",
            given[0],
        )
        return extra
    return ["--cache-ram", "0", *extra]


async def managed_command(settings: Settings, binary: Path | ServerBinary, port: int) -> Launch:
    """What to start for `--model` or `--models-dir` (exactly one of them is set)."""
    extra = no_prompt_cache(settings, list(settings.server_args))
    if settings.models_dir is not None:
        if settings.model:
            raise ServerError("give --model or --models-dir, not both")
        models_dir = settings.models_dir.expanduser()
        if not models_dir.is_dir():
            raise ServerError(f"--models-dir {models_dir}: no such directory")
        files = await asyncio.to_thread(gguf_files, models_dir)
        if not files:
            raise ServerError(f"--models-dir {models_dir} holds no .gguf model")
        infos = [await asyncio.to_thread(read_model_info, f) for f in files]
        command = router_command(
            binary,
            models_dir,
            settings.models_max,
            port,
            settings.cache_dir,
            settings.slots,
            settings.ctx_size,
            settings.api_key,
            swa_full(infos, extra),
        )
    else:
        assert settings.model
        model = await asyncio.to_thread(resolve_model, settings.model)
        info = await asyncio.to_thread(read_model_info, model)
        command = server_command(
            binary,
            model,
            port,
            settings.cache_dir,
            settings.slots,
            settings.ctx_size,
            settings.api_key,
            swa_full([info], extra),
        )
    return Launch(command, sleep_idle_seconds(extra))
