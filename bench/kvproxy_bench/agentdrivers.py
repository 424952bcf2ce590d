"""How `kvproxy bench agents` drives each client for one turn: the OpenAI SDK loop in-process,
the real agents as the user runs them (their CLI, a config of their own under a HOME of their
own, pointed at `base`). Which flags and config keys each one takes is in
/work/shared/CLIENTS.md, tests/test_real_agents.py and tests/test_openclaw.py (checked against
the clients themselves, not written from memory); OpenClaw's config is examples/openclaw.json,
validated by `openclaw config validate` before the first turn.

A driver's `turn` returns None when the client ran, else what went wrong (the benchmark
reports it beside the requests it did record)."""

from __future__ import annotations

import asyncio
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from kvproxy_bench import agentclients
from kvproxy_bench.dialogues import system_prompt

SDK, CODEX, CLAUDE_CODE, OPENCLAW, AIDER = "sdk", "codex", "claude", "openclaw", "aider"
CLIENTS = (SDK, CODEX, CLAUDE_CODE, OPENCLAW, AIDER)
PACKAGES: dict[str, agentclients.NpmPackage | agentclients.PypiPackage] = {
    CODEX: agentclients.CODEX,
    CLAUDE_CODE: agentclients.CLAUDE_CODE,
    OPENCLAW: agentclients.OPENCLAW,
    AIDER: agentclients.AIDER,
}
LABELS = {
    SDK: "OpenAI SDK",
    CODEX: "Codex",
    CLAUDE_CODE: "Claude Code",
    OPENCLAW: "OpenClaw",
    AIDER: "aider",
}
# A turn of a real agent may prefill a 10k-token prompt on a slow CPU, more than once.
TURN_TIMEOUT = 1800.0
EXAMPLES = Path(__file__).resolve().parent.parent.parent / "examples"
# An interrupted turn: a reply asked long enough to be still streaming when the user stops it
# this long after it began (the request's cap overrides the server's -n).
LONG_REPLY = 4000
INTERRUPT_AFTER = 2.0
# The clients whose turn can be stopped mid-reply as their user would (Ctrl-C, a UI's stop).
INTERRUPTIBLE = (SDK, CLAUDE_CODE)


@dataclass
class Settings:
    """What every driver of one run shares."""

    home: Path  # the client's HOME for this arm (created by the driver)
    base: str  # the recording tap's URL
    max_output: int  # reply cap, where the client has one
    sdk_prompt_tokens: int = 1400


class Driver(Protocol):
    name: str

    async def prepare(self) -> str | None: ...

    async def turn(self, session: int, first: bool, message: str) -> str | None: ...

    async def close(self) -> None: ...


class Interruptible(Driver, Protocol):
    async def interrupted_turn(
        self, session: int, message: str, replying: asyncio.Event
    ) -> str | None:
        """A turn asking for a long reply, stopped `INTERRUPT_AFTER` seconds after `replying`
        is set (the reply streams). None when it was stopped mid-reply, else what went wrong."""
        ...


def dated_prompt(day: int, head_tokens: int, in_sentence: bool = False) -> str:
    """A long system prompt with the day's date on a line ~400 tokens before its end (as
    OpenClaw writes `Current date: …` into its own): sessions of different days share the
    ~`head_tokens`-token head, and part at the date. `in_sentence`: the whole prompt is one
    paragraph, the date inside a sentence (`… reports. Current date: 2026-12-03. The …`)."""
    from kvproxy_bench.dialogues import facts_for

    head = system_prompt(7, facts_for(head_tokens))
    if in_sentence:
        tail = "".join(f"restock shelf {i % 13} before noon, then " for i in range(40))
        date = f"Current date: 2026-12-{day:02d}."
        return f"{head.replace(chr(10), ' ')} Write the daily reports. {date} The crews {tail}rest."
    tail = "".join(f"Note {i}: restock shelf {i % 13} before noon.\n" for i in range(40))
    return f"{head}\nCurrent date: 2026-12-{day:02d}\n{tail}"


async def run(command: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """A client's CLI run to the end, off the event loop's back (the tap shares the loop)."""
    proc = await asyncio.create_subprocess_exec(
        *command,
        env=env,
        cwd=cwd,
        stdin=asyncio.subprocess.DEVNULL,  # a pipe left open makes `claude -p` wait for input
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), TURN_TIMEOUT)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return -1, f"timed out after {TURN_TIMEOUT:g}s"
    return proc.returncode or 0, out.decode("utf-8", "replace")


def _failed(code: int, out: str) -> str:
    return f"exit {code}: {out.strip()[-300:]}"


@dataclass
class SdkDriver:
    """The OpenAI SDK loop: a system prompt of ~`sdk_prompt_tokens`, one question per turn,
    the reply echoed back as the SDK returned it."""

    settings: Settings
    name: str = SDK
    sessions: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    dated: bool = False  # the system prompt of dated_prompt: session N is on day N
    date_in_sentence: bool = False  # dated_prompt's one-paragraph form
    _client: Any = None

    async def prepare(self) -> str | None:
        from openai import AsyncOpenAI

        self._client = AsyncOpenAI(base_url=self.settings.base + "/v1", api_key="kvproxy-bench")
        return None

    async def turn(self, session: int, first: bool, message: str) -> str | None:
        from kvproxy_bench.dialogues import facts_for

        if first:
            tokens = self.settings.sdk_prompt_tokens
            prompt = (
                dated_prompt(session, tokens, self.date_in_sentence)
                if self.dated
                else system_prompt(7, facts_for(tokens))
            )
            self.sessions[session] = [{"role": "system", "content": prompt}]
        messages = self.sessions[session]
        messages.append({"role": "user", "content": message})
        done = await self._client.chat.completions.create(
            model="any", messages=messages, max_tokens=self.settings.max_output, temperature=0
        )
        messages.append({"role": "assistant", "content": done.choices[0].message.content or ""})
        return None

    async def interrupted_turn(
        self, session: int, message: str, replying: asyncio.Event
    ) -> str | None:
        """The reply streamed, and the stream closed mid-reply (a chat UI's stop button); the
        part shown is kept as the assistant's message, as such a UI keeps it."""
        messages = self.sessions[session]
        messages.append({"role": "user", "content": message})
        stream = await self._client.chat.completions.create(
            model="any", messages=messages, max_tokens=LONG_REPLY, temperature=0, stream=True
        )
        stop = asyncio.create_task(_after_replying(replying))
        shown: list[str] = []
        stopped = False
        try:
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    shown.append(chunk.choices[0].delta.content)
                if stop.done():
                    stopped = True
                    break
        finally:
            await stream.close()
            stop.cancel()
        messages.append({"role": "assistant", "content": "".join(shown)})
        return None if stopped else "the reply ended before it was interrupted"

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


@dataclass
class CodexDriver:
    """`codex exec`, then `codex exec resume --last` (the newest session: sessions run one
    after another). A custom provider on the Responses API (`wire_api = "chat"` is refused by
    0.171.0); Codex sends no output limit, so the servers run with `-n`."""

    settings: Settings
    exe: Path
    name: str = CODEX

    async def prepare(self) -> str | None:
        codex = self.settings.home / ".codex"
        await asyncio.to_thread(codex.mkdir, 0o700, True, True)
        config = (
            'model = "gemma"\n'
            'model_provider = "kvproxy"\n\n'
            "[model_providers.kvproxy]\n"
            'name = "kvproxy"\n'
            f'base_url = "{self.settings.base}/v1"\n'
            'wire_api = "responses"\n'
        )
        await asyncio.to_thread((codex / "config.toml").write_text, config)
        return None

    async def turn(self, session: int, first: bool, message: str) -> str | None:
        args = ["exec", "--skip-git-repo-check"]
        args += [message] if first else ["resume", "--last", message]
        home = self.settings.home
        code, out = await run([str(self.exe), *args], agentclients.client_env(home), home)
        return None if code == 0 else _failed(code, out)

    async def close(self) -> None:
        return None


@dataclass
class ClaudeCodeDriver:
    """`claude -p`, then `claude -p --continue` (the newest conversation in the directory).
    A reply cut at the output cap makes it continue in more requests and exit 1: the requests
    are what is measured, so only a run with none is a failure."""

    settings: Settings
    exe: Path
    name: str = CLAUDE_CODE

    async def prepare(self) -> str | None:
        await asyncio.to_thread(self.settings.home.mkdir, 0o700, True, True)
        return None

    def _env(self, max_output: int) -> dict[str, str]:
        return agentclients.client_env(
            self.settings.home,
            ANTHROPIC_BASE_URL=self.settings.base,
            ANTHROPIC_API_KEY="kvproxy-bench",
            DISABLE_TELEMETRY="1",
            CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
            CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(max_output),
        )

    async def turn(self, session: int, first: bool, message: str) -> str | None:
        home = self.settings.home
        args = ["-p", message] if first else ["-p", "--continue", message]
        code, out = await run([str(self.exe), *args], self._env(self.settings.max_output), home)
        return None if code in (0, 1) else _failed(code, out)

    async def interrupted_turn(
        self, session: int, message: str, replying: asyncio.Event
    ) -> str | None:
        """`claude -p --continue` stopped with SIGINT (Ctrl-C) while its reply streams."""
        proc = await asyncio.create_subprocess_exec(
            *(str(self.exe), "-p", "--continue", message),
            env=self._env(LONG_REPLY),
            cwd=self.settings.home,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            exited = asyncio.create_task(proc.wait())
            stop = asyncio.create_task(_after_replying(replying))
            await asyncio.wait(
                (exited, stop), timeout=TURN_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
            stop.cancel()
            if proc.returncode is not None:
                return f"claude exited ({proc.returncode}) before it was interrupted"
            proc.send_signal(signal.SIGINT)
            await asyncio.wait((exited,), timeout=30)
            return None
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    async def close(self) -> None:
        return None


@dataclass
class OpenClawDriver:
    """`openclaw agent --local --session-id …`: the embedded agent, no gateway. The config is
    examples/openclaw.json with the provider pointed at `base` and replies capped."""

    settings: Settings
    exe: Path
    name: str = OPENCLAW

    async def prepare(self) -> str | None:
        path = self.settings.home / ".openclaw" / "openclaw.json"
        config = json.loads(await asyncio.to_thread((EXAMPLES / "openclaw.json").read_text))
        provider = config["models"]["providers"]["kvproxy"]
        provider["baseUrl"] = self.settings.base + "/v1"
        provider["models"][0]["maxTokens"] = self.settings.max_output
        await asyncio.to_thread(path.parent.mkdir, 0o700, True, True)
        await asyncio.to_thread(path.write_text, json.dumps(config, indent=2))
        home = self.settings.home
        env = agentclients.client_env(home)
        code, out = await run([str(self.exe), "config", "validate"], env, home)
        return None if code == 0 else "openclaw config validate: " + _failed(code, out)

    async def turn(self, session: int, first: bool, message: str) -> str | None:
        home = self.settings.home
        args = ["agent", "--local", "--session-id", f"bench-{session}", "-m", message]
        args += ["--timeout", f"{TURN_TIMEOUT:.0f}"]
        code, out = await run([str(self.exe), *args], agentclients.client_env(home), home)
        return None if code == 0 else _failed(code, out)

    async def close(self) -> None:
        return None


@dataclass
class AiderDriver:
    """`aider --message …` in a directory of its own (no git), one process per turn; later
    turns of a session with `--restore-chat-history` (aider's way to carry a session across
    processes, which rewrites the prompt: measured, that is aider's cost). Flags checked
    against `aider --help` of the pinned release."""

    settings: Settings
    exe: Path
    name: str = AIDER

    async def prepare(self) -> str | None:
        await asyncio.to_thread(self.settings.home.mkdir, 0o700, True, True)
        return None

    async def turn(self, session: int, first: bool, message: str) -> str | None:
        home = self.settings.home
        args = [
            *("--model", "openai/any", "--openai-api-base", self.settings.base + "/v1"),
            *("--openai-api-key", "kvproxy-bench", "--no-git", "--yes-always"),
            *("--no-show-model-warnings", "--analytics-disable", "--no-check-update"),
            *("--restore-chat-history" if not first else "--no-restore-chat-history",),
            *("--message", message),
        ]
        env = agentclients.client_env(home)
        code, out = await run([str(self.exe), *args], env, home)
        return None if code == 0 else _failed(code, out)

    async def close(self) -> None:
        return None


async def _after_replying(replying: asyncio.Event) -> None:
    await replying.wait()
    await asyncio.sleep(INTERRUPT_AFTER)


def make_driver(name: str, settings: Settings, exe: Path | None) -> Driver:
    if name == SDK:
        return SdkDriver(settings)
    assert exe is not None
    if name == CODEX:
        return CodexDriver(settings, exe)
    if name == CLAUDE_CODE:
        return ClaudeCodeDriver(settings, exe)
    if name == AIDER:
        return AiderDriver(settings, exe)
    return OpenClawDriver(settings, exe)
