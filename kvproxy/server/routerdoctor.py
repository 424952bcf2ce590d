"""`kvproxy doctor` in front of a router-mode llama-server: the router's model list, then
each model's checks. What the router shows of a model it has not loaded (its GGUF path and
the flags its server will get, `status.args` of GET /models) is checked for every model;
a loaded model also gets the single-server checks through `?model=` / "model" (its slots,
a probe save, the probes). The doctor loads no model: that could unload another one."""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvproxy.http.session import UpstreamError
from kvproxy.server.checks import Check, Stop
from kvproxy.server.checkup import Doctor
from kvproxy.server.modellist import RouterModel, list_models


async def check_router(doctor: Doctor) -> list[Check]:
    try:
        models = await list_models(doctor.upstream)
    except UpstreamError as exc:
        doctor.add("router", "fail", f"llama-server is a router, but GET /models failed: {exc}")
        raise Stop from None
    limit = doctor.props.get("max_instances")
    at_once = f"at most {limit} loaded at once" if limit else "no limit on loaded models"
    if not models:
        doctor.add(
            "router",
            "fail",
            "llama-server is a router with no models",
            "start it with --models-dir DIR (a directory of .gguf files) or --models-preset",
        )
        raise Stop
    names = ", ".join(m.id for m in models)
    detail = f"llama-server is a router: {len(models)} models ({names}), {at_once}"
    doctor.add("router", "ok", detail)
    await doctor.check_cache_dir()
    for model in models:
        await check_model(doctor, model)
    return doctor.checks


async def check_model(doctor: Doctor, model: RouterModel) -> None:
    one = Doctor(doctor.settings, doctor.upstream, doctor.quick, model.id)
    if model.failed:
        one.add(
            "status",
            "fail",
            f"its server exited with code {model.exit_code} the last time the router started it",
            "see llama-server's log for the model's lines",
        )
    one.props = {"model_path": model.path}
    if model.status == "loaded":
        with contextlib.suppress(UpstreamError):
            one.props = await one.llama.props()
    await one.check_model()
    check_flags(one, model)
    if model.status == "loaded":
        with contextlib.suppress(Stop):
            await one.check_slots()
            await one.check_save_path()
            await one.probes()
    else:
        one.add(
            "probes",
            "warn",
            f"{model.status}: slots and probes not checked (the doctor loads no model)",
            "send it a request, then rerun to check it too",
        )
    doctor.checks += one.checks


def check_flags(one: Doctor, model: RouterModel) -> None:
    """What the router will start the model's server with (its own flags, passed on)."""
    cache_dir = one.cache_dir
    saved_to = model.slot_save_path
    if saved_to is None:
        one.add(
            "slot save path",
            "fail",
            "its server gets no --slot-save-path: slot save/restore is off",
            f"start the router with --slot-save-path {cache_dir} (it passes it on)",
        )
    elif not _same_dir(Path(saved_to), cache_dir):
        one.add(
            "slot save path",
            "fail",
            f"its server saves slots in {saved_to}, not in {cache_dir}",
            f"start the router with --slot-save-path {cache_dir} "
            "(the same dir as kvproxy's --cache-dir)",
        )
    if one.model is not None and one.model.has_swa and "--swa-full" not in model.args:
        one.add(
            "swa",
            "fail",
            "a sliding-window model whose server gets no --swa-full: no restore is reused",
            "start the router with --swa-full (it passes it on)",
        )


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b
