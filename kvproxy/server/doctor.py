"""`kvproxy doctor`: checks a running llama-server and cache dir for what kvproxy needs (its
command line is `kvproxy.cli.doctor`, so other commands do not import this module and aiohttp).

Each check is ok, warn or fail, with the exact flag to change (checks.py); any fail exits 1.
One server's checks are checkup.py's; a router's, model by model, routerdoctor.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from typing import Any

from kvproxy.config import Settings
from kvproxy.http.session import Upstream
from kvproxy.server.checks import Check, Stop
from kvproxy.server.checkup import Doctor
from kvproxy.server.findlocal import NOT_FOUND, local_server
from kvproxy.server.leftover import managed_urls
from kvproxy.server.modelinfo import model_identity
from kvproxy.server.modellist import is_router
from kvproxy.server.routerdoctor import check_router


async def run(doctor: Doctor) -> list[Check]:
    """One server's checks, or, for a router, each model's."""
    with contextlib.suppress(Stop):
        await doctor.check_health()
        await doctor.check_auth()
        if is_router(doctor.props):  # its checks build a Doctor per model
            return await check_router(doctor)
        await doctor.check_model()
        await doctor.check_slots()
        await doctor.check_cache_dir()
        await doctor.check_save_path()
        await doctor.probes()
    return doctor.checks


async def diagnose(settings: Settings, quick: bool = False) -> list[Check]:
    """Every check on every server (--upstream given several times: each one's checks are
    named with its address, and one more says whether they serve each other's conversations)."""
    urls, found = settings.upstream_urls, []
    if not urls:  # none given: those a kvproxy started on this cache dir, else port 8080/9931
        urls = await asyncio.to_thread(managed_urls, settings.cache_dir)
        where = f"{', '.join(urls)}: started by kvproxy on {settings.cache_dir}"
        found = [Check("found", "ok", where)] if urls else []
        urls = urls or await local_server()
    if not urls:
        why, fix = NOT_FOUND
        where = f"{why}, and no kvproxy started one on {settings.cache_dir}"
        return [Check("server", "fail", where, fix)]
    doctors = [await _examine(settings, url, quick) for url in urls]
    if len(doctors) == 1:
        return [*found, *doctors[0].checks]
    checks = [
        replace(c, name=f"{c.name} [{url.split('://', 1)[-1]}]")
        for url, doctor in zip(urls, doctors, strict=True)
        for c in doctor.checks
    ]
    return [*found, *checks, same_model(urls, [d.props for d in doctors])]


async def _examine(settings: Settings, url: str, quick: bool) -> Doctor:
    upstream = Upstream(url, settings.api_key)
    await upstream.start()
    try:
        doctor = Doctor(settings, upstream, quick)
        await run(doctor)
        return doctor
    finally:
        await upstream.close()


def same_model(urls: list[str], props: list[dict[str, Any]]) -> Check:
    """Servers restore each other's conversations only with the same model identity (the
    model file, its size and time, the context per slot): else each keeps its own."""
    identities = [model_identity(p) if p else "" for p in props]
    if all(identities) and len(set(identities)) == 1:
        return Check(
            "same model", "ok", f"all {len(urls)} servers serve the same model and context"
        )
    differ = ", ".join(
        f"{url.split('://', 1)[-1]}: {ident.split('|', 1)[0] or 'unknown'}"
        for url, ident in zip(urls, identities, strict=True)
    )
    return Check(
        "same model",
        "warn",
        f"the servers differ in model or context per slot ({differ}): a conversation "
        "saved on one is not restored on another",
        "start every server with the same model file, --ctx-size and --parallel",
    )
