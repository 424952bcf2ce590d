"""examples/: each runs as a user would run it, against kvproxy in front of a real llama-server.

The bundled Gemma 3 270M answers with echo-like noise, so these check what the examples print
(kvproxy's verdicts, streamed content, how the tool loop ended), not what the model says.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import openai
import pytest
from openai.types.chat import ChatCompletionMessage, ChatCompletionMessageParam

from kvproxy.config import Settings

from .conftest import RealServer, RunningProxy, start_proxy

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
CACHED = ("resident", "restored")


@pytest.fixture
async def rproxy(real_server: RealServer) -> AsyncIterator[RunningProxy]:
    running = await start_proxy(real_server.url, real_server.cache_dir)
    yield running
    await running.stop()


async def run_example(proxy: RunningProxy, *argv: str, path: str | None = None) -> str:
    """Runs an example against `proxy` the documented way (OPENAI_BASE_URL); its stdout."""
    env = {**os.environ, "OPENAI_BASE_URL": proxy.url + "/v1", "OPENAI_API_KEY": "examples"}
    if path is not None:
        env["PATH"] = path
    # The proxy runs in this event loop: wait for the example without blocking it.
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=EXAMPLES.parent,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    text = out.decode()
    assert proc.returncode == 0, f"{argv} exited {proc.returncode}:\n{text}\n{err.decode()}"
    return text


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.real
async def test_openai_chat(rproxy: RunningProxy) -> None:
    out = await run_example(rproxy, sys.executable, "examples/openai_chat.py")
    assert out.count("assistant: ") == 2, out
    verdicts = re.findall(r"^turn \d: X-KVProxy-Cache=(\w+) reused=(\d+)", out, re.M)
    assert len(verdicts) == 2, out
    # Turn 2 resends turn 1: kvproxy recognises it and the server reuses those tokens.
    assert verdicts[1][0] in CACHED and int(verdicts[1][1]) > 0, out


@pytest.mark.real
async def test_openai_stream(rproxy: RunningProxy) -> None:
    out = await run_example(rproxy, sys.executable, "examples/openai_stream.py")
    assert re.match(r"X-KVProxy-Cache: (resident|restored|miss)\n", out), out
    summary = re.search(r"^\[(\d+) content chunks; (\d+) prompt \+ (\d+) completion", out, re.M)
    assert summary, out
    assert int(summary[1]) > 0 and int(summary[3]) > 0, out


@pytest.mark.real
async def test_openai_tools(rproxy: RunningProxy) -> None:
    """The tiny model may or may not call the tool: the loop ends cleanly and says which."""
    out = await run_example(rproxy, sys.executable, "examples/openai_tools.py")
    assert out.startswith("round 1: X-KVProxy-Cache="), out
    assert re.search(r"^(the model answered|stopped after \d+ rounds)", out, re.M), out
    if "tool get_weather(" in out:
        assert "round 2: X-KVProxy-Cache=" in out, out


@pytest.mark.real
async def test_a_tool_round_goes_back_through_kvproxy(rproxy: RunningProxy) -> None:
    """The half of the tool loop the tiny model seldom reaches: the example's own code runs the
    tool and echoes the call; the server accepts that history and kvproxy keeps it cached."""
    tools = load_example("openai_tools")
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    message = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [call]}
    )
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    tools.add_tool_round(messages, message)
    assert messages[1]["tool_calls"][0]["id"] == "call_1"
    assert messages[2] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": json.dumps({"city": "Paris", "sky": "sunny", "celsius": 21}),
    }
    assert "error" in json.loads(tools.run_tool("get_weather", '{"town": "Paris"}'))

    client = openai.AsyncOpenAI(base_url=rproxy.url + "/v1", api_key="examples", max_retries=0)
    verdicts = []
    async with client:
        for _ in range(2):
            raw = await client.chat.completions.with_raw_response.create(
                # the example's history: plain dicts, as the SDK takes them
                model="local",
                messages=cast("list[ChatCompletionMessageParam]", messages),
                tools=tools.TOOLS,
                max_tokens=8,
            )
            raw.parse()
            verdicts.append(raw.headers["x-kvproxy-cache"])
    assert verdicts[1] in CACHED, verdicts


@pytest.mark.real
async def test_curl_script(rproxy: RunningProxy) -> None:
    assert shutil.which("curl"), "curl is missing: apt-get install curl"
    out = await run_example(rproxy, "bash", "examples/curl.sh")
    verdicts = re.findall(r"^X-KVProxy-Cache: (\w+)", out, re.M | re.I)
    assert len(verdicts) == 2 and verdicts[1] in CACHED, out
    assert "data: [DONE]" in out, out
    stats = json.loads(out.strip().splitlines()[-1])
    assert sum(stats["requests"].values()) >= 3, stats


async def test_aider_script_points_aider_at_kvproxy(tmp_path: Path) -> None:
    """aider itself is not installed here: a stand-in on PATH records how it is called."""
    fake = tmp_path / "aider"
    fake.write_text('#!/bin/sh\necho "base=$OPENAI_API_BASE key=$OPENAI_API_KEY args=$*"\n')
    fake.chmod(0o755)
    path = f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OPENAI_")}
    for extra, expected_base in (
        ({}, "http://localhost:8081/v1"),
        ({"OPENAI_BASE_URL": "http://box:9000/v1"}, "http://box:9000/v1"),
    ):
        proc = await asyncio.create_subprocess_exec(
            "bash",
            str(EXAMPLES / "aider.sh"),
            "--yes",
            env={**env, **extra, "PATH": path},
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        line = out.decode().strip()
        assert line.startswith(f"base={expected_base} key=none args="), line
        assert "--model openai/local" in line and line.endswith("--yes"), line


def test_openclaw_config_points_at_kvproxy() -> None:
    config = json.loads((EXAMPLES / "openclaw.json").read_text())
    defaults = Settings.model_fields
    providers = config["models"]["providers"]
    assert list(providers) == ["kvproxy"]
    provider = providers["kvproxy"]
    expected = f"http://{defaults['host'].default}:{defaults['port'].default}/v1"
    assert provider["baseUrl"] == expected
    assert provider["api"] == "openai-completions"
    model_ids = [m["id"] for m in provider["models"]]
    assert config["agents"]["defaults"]["model"]["primary"] in [f"kvproxy/{m}" for m in model_ids]
    # A stable system prompt from turn to turn (see docs/troubleshooting.md).
    assert config["agents"]["defaults"]["contextInjection"] in ("always", "never")


@pytest.mark.parametrize(
    "name", ["openai_chat.py", "openai_stream.py", "openai_tools.py", "curl.sh", "aider.sh"]
)
def test_examples_default_to_kvproxy_serve_address(name: str) -> None:
    """`kvproxy serve --model default` listens on localhost:8081; the examples go there."""
    port = Settings.model_fields["port"].default
    assert f"http://localhost:{port}/v1" in (EXAMPLES / name).read_text()
