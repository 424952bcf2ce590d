"""One llama-server's checks for `kvproxy doctor` (server/doctor.py runs them on every server,
routerdoctor.py on each model of a router), in the order a user would fix them.

Without `--quick`, three probes use idle slots: whether an idle slot keeps its tokens when
another slot works, whether the server reuses a restored state — the one thing that decides if
restores save any time on this model — and whether its RAM prompt cache is on
(promptcache.py). They and the probe save evaluate, save and erase slots, so while a kvproxy
serves from the cache dir (store/presence.py) they are skipped with a note: a running
proxy's slots hold its conversations, and a slot action beside its own could hang them.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import stat
from pathlib import Path
from typing import Any

from kvproxy import readable
from kvproxy.config import Settings
from kvproxy.http.session import Upstream, UpstreamError
from kvproxy.server.api import LlamaClient, ModelRoute, SlotInfo
from kvproxy.server.checks import Check, Status, Stop
from kvproxy.server.modelinfo import ModelInfo, read_model_info
from kvproxy.server.promptcache import NAME, check_prompt_cache
from kvproxy.server.savepath import probe_check, probe_save_path
from kvproxy.store.presence import served_from

FILLER = "The quick brown fox jumps over the lazy dog while the cache keeps every token. "
EXTENSION = " And then the story goes on with a few more words."


class Doctor:
    """The checks of one server, or of one `model` of a router (named after it)."""

    def __init__(
        self, settings: Settings, upstream: Upstream, quick: bool, model: str | None = None
    ) -> None:
        self.settings = settings
        self.upstream = upstream
        self.model_name = model
        self.llama = LlamaClient(upstream, ModelRoute(model) if model else None)
        self.quick = quick
        self.checks: list[Check] = []
        self.props: dict[str, Any] = {}
        self.slots: list[SlotInfo] = []
        self.model: ModelInfo | None = None
        self.cache_dir = Path(settings.cache_dir)

    def add(self, name: str, status: Status, detail: str, fix: str = "") -> None:
        name = f"{self.model_name}: {name}" if self.model_name else name
        self.checks.append(Check(name, status, detail, fix))

    async def probes(self) -> None:
        beside = await self._beside_proxy()
        if self.quick or beside:
            why = beside or "--quick"
            for name in ("idle slots kept", "restore reuse", NAME):
                self.add(name, "warn", f"not probed ({why})")
        else:
            await self.check_idle_wipe()
            await self.check_restore_reuse()
            found = await check_prompt_cache(self.llama, self.slots)
            self.add(found.name, found.status, found.detail, found.fix)

    # --- the checks, in the order a user would fix them

    async def check_health(self) -> None:
        url = self.upstream.base_url
        try:
            await self.llama.health()
        except UpstreamError as exc:
            if exc.status == 503:
                self.add("server", "fail", f"{url} is still loading its model", "wait, then rerun")
            else:
                self.add(
                    "server",
                    "fail",
                    f"cannot reach llama-server at {url}: {exc}",
                    "start llama-server, or pass --upstream URL (env KVPROXY_UPSTREAM)",
                )
            raise Stop from None
        self.add("server", "ok", f"{url} is up and healthy")

    async def check_auth(self) -> None:
        try:
            self.props = await self.llama.props()
        except UpstreamError as exc:
            if exc.status == 401:
                if self.upstream.api_key:
                    self.add(
                        "API key",
                        "fail",
                        "llama-server refused the API key",
                        "set --upstream-api-key to one of llama-server's --api-key values",
                    )
                else:
                    self.add(
                        "API key",
                        "fail",
                        "llama-server needs an API key",
                        "pass --upstream-api-key KEY (env KVPROXY_UPSTREAM_API_KEY)",
                    )
            else:
                self.add("API key", "fail", f"GET /props failed: {exc}")
            raise Stop from None
        needed = "accepted" if self.upstream.api_key else "not needed"
        self.add("API key", "ok", needed)

    async def check_model(self) -> None:
        path = str(self.props.get("model_path") or "")
        if not path:
            self.add("model class", "warn", "llama-server did not say which model it loaded")
            return
        info = await asyncio.to_thread(read_model_info, path)
        if info.model_class == "unknown":
            self.add(
                "model class",
                "warn",
                f"cannot read {path} from here; the restore probe below still tells",
            )
            return
        self.model = info
        detail = f"{info.architecture}: {info.model_class}"
        if info.has_swa:
            detail += f" (sliding window {info.n_swa})"
        rule = {
            "prefix": "any common prefix is reused after a restore",
            "extension": "a restore is reused only when the next prompt extends it exactly "
            "(kvproxy saves the canonical prefix for that)",
            "none": "",
        }[info.restore_reuse()]
        if info.has_swa:
            rule = "a restore is reused only with llama-server --swa-full (then any prefix)"
        self.add("model class", "ok", f"{detail}; {rule}")

    async def check_slots(self) -> None:
        try:
            self.slots = await self.llama.slots()
        except UpstreamError as exc:
            fix = "start llama-server with --slots" if exc.status == 501 else ""
            self.add("slots", "fail", f"GET /slots failed: {exc}", fix)
            raise Stop from None
        n = len(self.slots)
        n_ctx = self.slots[0].n_ctx if self.slots else None
        if n == 1:
            self.add(
                "slots",
                "warn",
                f"1 slot of {n_ctx} tokens: every other conversation evicts the last one",
                "start llama-server with -np 2 or more (and --ctx-size = slots × tokens each)",
            )
        else:
            self.add("slots", "ok", f"{n} slots of {n_ctx} tokens each")

    async def check_cache_dir(self) -> None:
        problem = await asyncio.to_thread(_cache_dir_problem, self.cache_dir)
        if problem is not None:
            status, detail, fix = problem
            self.add("cache dir", status, detail, fix)
            if status == "fail":
                raise Stop
            return
        free = (await asyncio.to_thread(shutil.disk_usage, self.cache_dir)).free
        budget = int(self.settings.max_disk)
        if free < budget:
            self.add(
                "cache dir",
                "warn",
                f"{self.cache_dir}: {readable.size(free)} free, "
                f"less than --max-disk {readable.size(budget)}",
                f"lower --max-disk below {readable.size(free)} or free disk space",
            )
        else:
            self.add("cache dir", "ok", f"{self.cache_dir}: private, {readable.size(free)} free")

    async def check_save_path(self) -> None:
        beside = await self._beside_proxy()
        if beside:
            self.add("slot save path", "warn", f"not probed ({beside})")
            return
        status, detail, fix = probe_check(await probe_save_path(self.llama, self.cache_dir))
        self.add("slot save path", status, detail, fix)
        if status == "fail":
            raise Stop

    async def check_idle_wipe(self) -> None:
        idle = [s.id for s in self.slots if not s.is_processing]
        if len(self.slots) < 2:
            self.add("idle slots kept", "ok", "one slot: nothing else can wipe it")
            return
        if len(idle) < 2:
            self.add("idle slots kept", "warn", "fewer than 2 idle slots: not probed")
            return
        keep, work = idle[0], idle[1]
        tokens = await self._tokens(FILLER * 2)
        await self.llama.evaluate(keep, tokens)
        await self.llama.evaluate(work, tokens[: len(tokens) // 2])
        kept = (await self.llama.slot(keep)).n_prompt_tokens
        await self.llama.erase(keep)
        await self.llama.erase(work)
        if not kept:
            self.add(
                "idle slots kept",
                "fail",
                "llama-server wiped an idle slot when another slot started work "
                "(unified KV cache with --cache-idle-slots)",
                "start llama-server with -np N --no-kv-unified (or --no-cache-idle-slots)",
            )
        else:
            self.add("idle slots kept", "ok", f"slot {keep} kept its {kept} tokens")

    async def check_restore_reuse(self) -> None:
        slot = self._idle_slot()
        if slot is None:
            self.add("restore reuse", "warn", "every slot is busy: not probed")
            return
        n_ctx = self.slots[0].n_ctx or 4096
        # Past the sliding window, where SWA models lose what a restore brought back.
        target = min((self.model.n_swa if self.model else 0) + 128, n_ctx // 2)
        filler = await self._tokens(FILLER)
        prompt = (filler * (target // max(len(filler), 1) + 1))[: max(target, 64)]
        longer = [*prompt, *(await self._tokens(EXTENSION, special=False))]
        name = f"{secrets.token_hex(16)}.doctor.tmp"
        try:
            await self.llama.evaluate(slot, prompt)
            await self.llama.save(slot, name, timeout=120)
            await self.llama.erase(slot)
            await self.llama.restore(slot, name, timeout=120)
            timings = await self.llama.evaluate(slot, longer)
        finally:
            await asyncio.to_thread(_unlink, self.cache_dir / name)
            with contextlib.suppress(UpstreamError):
                await self.llama.erase(slot)
        cache_n = int(timings.get("cache_n", 0))
        if cache_n >= len(prompt) // 2:
            self.add(
                "restore reuse",
                "ok",
                f"after save → erase → restore of {len(prompt)} tokens, {cache_n} were reused",
            )
            return
        if self.model is not None and self.model.has_swa:
            fix = (
                "restart llama-server with --swa-full (every layer then keeps the whole "
                "context: more KV memory)"
            )
            why = "a sliding-window model without --swa-full"
        else:
            fix = "check llama-server's flags and version; kvproxy will stop restoring for it"
            why = "this model/flags combination"
        self.add(
            "restore reuse",
            "fail",
            f"llama-server reused {cache_n} of {len(prompt)} restored tokens: {why}; "
            "every restore would be wasted I/O",
            fix,
        )

    # --- helpers

    async def _beside_proxy(self) -> str:
        """Why the probes must leave the slots alone ("" when they may use them)."""
        if not await asyncio.to_thread(served_from, self.cache_dir):
            return ""
        return (
            f"a kvproxy is serving from {self.cache_dir}: its slots are left alone; stop it "
            "to probe them"
        )

    def _idle_slot(self) -> int | None:
        return next((s.id for s in self.slots if not s.is_processing), None)

    async def _tokens(self, text: str, special: bool = True) -> list[int]:
        return await self.llama.tokenize(text, add_special=special)


def _cache_dir_problem(path: Path) -> tuple[Status, str, str] | None:
    if not path.is_dir():
        return "fail", f"{path} does not exist", f"mkdir -m 700 -p {path}"
    if not os.access(path, os.W_OK | os.X_OK):
        return "fail", f"{path} is not writable by this user", "run as the service's user"
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        return (
            "warn",
            f"{path} is readable by others (mode {mode:o}): conversations are in it",
            f"chmod 700 {path}",
        )
    return None


def _unlink(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
