"""deploy/: the systemd units verify (the llama-server template instantiated, and with the
drop-ins deploy/README.md gives for a second server), keep their hardening, agree on the shared
cache dir, and start a working llama-server + kvproxy pair; kvproxy.env names only real
settings."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvproxy.config import Settings
from kvproxy.server.managed import find_server_binary, free_port, server_command

from .conftest import bundled_model, run_server_command, server_loop

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
TEMPLATE = "llama-server@.service"
UNITS = ("kvproxy.service", TEMPLATE)
# The instance kvproxy.service wants: the instance name is the port.
INSTANCE = "llama-server@8080.service"
CACHE_DIR = "/var/cache/kvproxy"
# The paths the units use, as deploy/README.md installs them.
KVPROXY_BIN = "/opt/kvproxy/venv/bin/kvproxy"
LLAMA_BIN = "/usr/local/bin/llama-server"
ENV_FILE = "/etc/kvproxy/kvproxy.env"


def unit_settings(name: str) -> dict[str, list[str]]:
    """Directive -> its values in order, from the [Service]/[Unit]/[Install] sections."""
    return parse_unit((DEPLOY / name).read_text())


def parse_unit(text: str) -> dict[str, list[str]]:
    lines = text.splitlines()
    joined: list[str] = []
    carry = ""
    for line in lines:
        if line.lstrip().startswith(("#", ";")) and not carry:
            continue
        if line.endswith("\\"):
            carry += line[:-1] + " "
            continue
        joined.append(carry + line)
        carry = ""
    out: dict[str, list[str]] = {}
    for line in joined:
        if "=" in line and not line.startswith("["):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def env_file() -> str:
    return (DEPLOY / "kvproxy.env").read_text()


def active_env() -> dict[str, str]:
    """The KEY=value lines kvproxy.env sets (comments excluded)."""
    pairs = {}
    for line in env_file().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, value = line.split("=", 1)
            pairs[key.strip()] = value.strip()
    return pairs


def kvproxy_bin() -> Path:
    path = Path(sys.executable).parent / "kvproxy"
    assert path.is_file(), f"{path}: kvproxy is not installed in this venv"
    return path


def installed_copies(tmp_path: Path, *ports: int) -> list[Path]:
    """The units with their binaries and env file pointed at real files on this machine:
    kvproxy.service, then an instance of the template for each port (8080 by default), a link
    to it as `systemctl enable llama-server@PORT` makes, so that %i is the port."""
    for name in UNITS:
        text = (DEPLOY / name).read_text()
        text = text.replace(KVPROXY_BIN, str(kvproxy_bin()))
        text = text.replace(LLAMA_BIN, str(find_server_binary(None)))
        text = text.replace(ENV_FILE, str(DEPLOY / "kvproxy.env"))
        (tmp_path / name).write_text(text)
    instances = []
    for port in ports or (8080,):
        instance = tmp_path / TEMPLATE.replace("@", f"@{port}")
        instance.symlink_to(TEMPLATE)
        instances.append(instance)
    return [tmp_path / "kvproxy.service", *instances]


def about_ours(output: str) -> list[str]:
    """systemd-analyze's lines about our units, their instances or drop-ins."""
    return [
        line for line in output.splitlines() if "kvproxy.service" in line or "llama-server@" in line
    ]


def systemd_analyze() -> str:
    found = shutil.which("systemd-analyze")
    assert found, "systemd-analyze is missing: apt-get install systemd"
    return found


def verify(units: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [systemd_analyze(), "verify", "--man=no", *map(str, units)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_units_verify(tmp_path: Path) -> None:
    done = verify(installed_copies(tmp_path))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert about_ours(output) == [], output


@pytest.mark.parametrize(("name", "reported_as"), [("kvproxy.service",) * 2, (TEMPLATE, INSTANCE)])
def test_verify_catches_a_broken_unit(tmp_path: Path, name: str, reported_as: str) -> None:
    """The check above is live: a misspelt directive and a missing binary are reported, the
    template's through its instance (%i is 8080 there)."""
    units = installed_copies(tmp_path)
    broken = tmp_path / name
    text = broken.read_text().replace("ProtectSystem=", "ProtectSytem=")
    for binary in (kvproxy_bin(), find_server_binary(None)):
        text = text.replace(str(binary), "/nonexistent/binary")
    broken.write_text(text)
    done = verify(units)
    output = done.stdout + done.stderr
    assert done.returncode != 0
    assert "ProtectSytem" in output
    missing = [line for line in output.splitlines() if "/nonexistent/binary" in line]
    assert missing and all(line.startswith(reported_as) for line in missing), output


def readme_block(containing: str) -> str:
    """The body of the one code block of deploy/README.md holding `containing`, dedented (or
    of the heredoc holding it)."""
    readme = (DEPLOY / "README.md").read_text()
    blocks = re.findall(r"^( *)```\w*\n(.*?)^\1```", readme, flags=re.M | re.S)
    found = [textwrap.dedent(body) for _, body in blocks if containing in body]
    assert len(found) == 1, (containing, found)
    heredoc = re.search(r"<<'EOF'\n(.*?)^EOF$", found[0], flags=re.M | re.S)
    return heredoc.group(1) if heredoc else found[0]


def two_servers(tmp_path: Path) -> list[Path]:
    """The units installed and changed as deploy/README.md's "Several servers" says: a second
    instance, kvproxy's drop-in wanting it, and the second GPU in that instance's drop-in."""
    units = installed_copies(tmp_path, 8080, 8082)
    for directory, name, containing in (
        ("kvproxy.service.d", "override.conf", "Wants=llama-server@8082.service"),
        ("llama-server@8082.service.d", "gpu.conf", "CUDA_VISIBLE_DEVICES"),
    ):
        (tmp_path / directory).mkdir()
        (tmp_path / directory / name).write_text(readme_block(containing))
    return units


def test_the_second_server_deploy_readme_sets_up_verifies(tmp_path: Path) -> None:
    units = two_servers(tmp_path)
    done = verify(units)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert about_ours(output) == [], output
    dropin = parse_unit((tmp_path / "kvproxy.service.d" / "override.conf").read_text())
    assert dropin["Wants"] == dropin["After"] == ["llama-server@8082.service"]
    # The drop-ins are read: a misspelt directive in either is reported.
    confs = sorted(tmp_path.glob("*.service.d/*.conf"))
    for conf in confs:
        conf.write_text(conf.read_text().replace("\n", "\nMisspeltKey=1\n", 1))
    done = verify(units)
    reported = {line.split(":")[0] for line in about_ours(done.stderr) if "MisspeltKey" in line}
    assert reported == {str(conf) for conf in confs}, done.stderr


def test_the_readme_upstream_list_names_the_servers_the_units_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """KVPROXY_UPSTREAM as "Several servers" sets it: a valid setting naming the ports of the
    instance kvproxy.service wants and of the one its drop-in adds."""
    line = readme_block("KVPROXY_UPSTREAM=").strip()
    key, value = line.split("=", 1)
    for name in list(os.environ):
        if name.startswith("KVPROXY_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv(key, value)
    wanted = [
        *unit_settings("kvproxy.service")["Wants"],
        *parse_unit(readme_block("Wants=llama-server@8082"))["Wants"],
    ]
    ports = [re.fullmatch(r"llama-server@(\d+)\.service", w) for w in wanted]
    assert wanted == [INSTANCE, "llama-server@8082.service"]
    assert Settings().upstream_urls == [f"http://127.0.0.1:{m.group(1)}" for m in ports if m]


@pytest.mark.parametrize("name", UNITS)
def test_units_are_hardened(name: str) -> None:
    unit = unit_settings(name)
    for key, value in {
        "NoNewPrivileges": "yes",
        "ProtectSystem": "strict",
        "PrivateTmp": "yes",
        "ProtectHome": "yes",
        "Restart": "on-failure",
        "ReadWritePaths": CACHE_DIR,
        "CacheDirectory": "kvproxy",
        "CacheDirectoryMode": "0700",
        "UMask": "0077",
        "CapabilityBoundingSet": "",
    }.items():
        assert unit.get(key) == [value], (name, key, unit.get(key))


def test_both_units_share_one_user_and_the_cache_dir() -> None:
    """llama-server writes 0600 state files that kvproxy renames and deletes: same owner."""
    kv, llama = unit_settings("kvproxy.service"), unit_settings(TEMPLATE)
    assert kv["User"] == llama["User"] and kv["Group"] == llama["Group"]
    assert kv["User"] != ["root"]
    words = llama["ExecStart"][0].split()
    assert words[words.index("--slot-save-path") + 1] == CACHE_DIR
    assert active_env()["KVPROXY_CACHE_DIR"] == CACHE_DIR
    assert kv["EnvironmentFile"] == [ENV_FILE]
    assert kv["ExecStart"] == [f"{KVPROXY_BIN} serve"]
    # kvproxy saves every slot on SIGTERM: it must stop before the server does.
    assert kv["Wants"] == [INSTANCE]
    assert INSTANCE in kv["After"][0].split()


def test_llama_server_unit_has_the_flags_kvproxy_needs(tmp_path: Path) -> None:
    """The same words managed mode uses, plus --swa-full for sliding-window models."""
    managed = server_command(Path("llama-server"), Path("m.gguf"), 1, tmp_path, 2, 256, None, [])
    words = unit_settings(TEMPLATE)["ExecStart"][0].split()
    for flag in ("--slot-save-path", "--parallel", "--no-kv-unified", "--ctx-size"):
        assert flag in managed and flag in words, flag
    assert "--swa-full" in words
    assert words[words.index("--host") + 1] == "127.0.0.1"
    assert words[words.index("--port") + 1] == "%i"  # the instance name is the port


@pytest.mark.real
def test_the_sigill_fix_the_docs_give_reaches_the_server() -> None:
    """deploy/README.md's drop-in for CPUs that die with SIGILL: the flag is one this
    llama-server takes, and LLAMA_EXTRA_ARGS ends up as its own words on the command line."""
    readme = (DEPLOY / "README.md").read_text()
    assert 'Environment="LLAMA_EXTRA_ARGS=--no-repack"' in readme
    words = unit_settings(TEMPLATE)["ExecStart"][0].split()
    assert words[-1] == "$LLAMA_EXTRA_ARGS"
    assert expand(words[-1], {"LLAMA_EXTRA_ARGS": "-ngl 99 --no-repack"}) == [
        "-ngl",
        "99",
        "--no-repack",
    ]
    helped = subprocess.run(
        [str(find_server_binary(None)), "--help"], capture_output=True, text=True, timeout=60
    )
    assert "--no-repack" in helped.stdout + helped.stderr


@pytest.mark.real
def test_the_per_instance_variables_the_docs_give_are_read_by_the_server() -> None:
    """deploy/README.md picks a GPU or the cores per instance with LLAMA_ARG_DEVICE and
    LLAMA_ARG_THREADS: this llama-server reads both (an unknown device is refused, naming the
    variable)."""
    readme = (DEPLOY / "README.md").read_text()
    assert "Environment=LLAMA_ARG_DEVICE=" in readme
    assert "Environment=LLAMA_ARG_THREADS=" in readme
    binary = str(find_server_binary(None))
    helped = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=60)
    assert "(env: LLAMA_ARG_THREADS)" in helped.stdout + helped.stderr
    refused = subprocess.run(
        [binary, "--model", "/nonexistent.gguf", "--port", str(free_port())],
        env={**os.environ, "LLAMA_ARG_DEVICE": "NoSuchDevice7"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "LLAMA_ARG_DEVICE" in said and "NoSuchDevice7" in said, said


def test_env_file_names_only_real_settings() -> None:
    named = set(re.findall(r"\bKVPROXY_[A-Z0-9_]+", env_file()))
    fields = {f"KVPROXY_{name.upper()}" for name in Settings.model_fields}
    assert named, "no KVPROXY_ variables found"
    assert named <= fields, f"not settings: {sorted(named - fields)}"


def test_env_file_names_every_setting() -> None:
    """A setting missing from the file is one an operator never hears of (#37)."""
    named = set(re.findall(r"\bKVPROXY_[A-Z0-9_]+", env_file()))
    fields = {f"KVPROXY_{name.upper()}" for name in Settings.model_fields}
    assert fields <= named, f"settings kvproxy.env does not name: {sorted(fields - named)}"


def test_env_file_comments_show_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    """`#KVPROXY_X=value` lines promise kvproxy's default: uncommented, nothing changes."""
    for key in list(os.environ):
        if key.startswith("KVPROXY_"):
            monkeypatch.delenv(key)
    default = Settings()
    shown = re.findall(r"^#(KVPROXY_[A-Z0-9_]+)=(\S+)$", env_file(), re.MULTILINE)
    assert len(shown) > 10
    for key, value in shown:
        with monkeypatch.context() as env:
            env.setenv(key, value)
            name = key.removeprefix("KVPROXY_").lower()
            assert getattr(Settings(), name) == getattr(default, name), f"{key}={value}"


def test_env_file_values_are_valid(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.startswith("KVPROXY_"):
            monkeypatch.delenv(key)
    for key, value in active_env().items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.upstream_url == "http://127.0.0.1:8080"
    assert settings.loopback and settings.port == 8081
    assert str(settings.cache_dir) == CACHE_DIR


def expand(word: str, env: dict[str, str]) -> list[str]:
    """systemd's ExecStart expansion: ${VAR} stays one word, a bare $VAR splits on spaces."""
    bare = re.fullmatch(r"\$([A-Za-z_][A-Za-z0-9_]*)", word)
    if bare:
        return env.get(bare.group(1), "").split()
    return [re.sub(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: env[m.group(1)], word)]


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until caching is on: /health answers while the cache dir opens (requests are then
    served uncached) and before kvproxy has found its llama-server."""
    for _ in range(600):
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/kvproxy/stats", timeout=2) as resp:
                if resp.status == 200 and json.loads(resp.read()).get("enabled"):
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy: {log.read_text()[-3000:]}")


def chat(url: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as resp:
        return resp.headers["X-KVProxy-Cache"], json.loads(resp.read())


@pytest.mark.real
def test_the_units_commands_work_together(tmp_path: Path) -> None:
    """llama-server@PORT's ExecStart and kvproxy.service's ExecStart + env file, run as
    systemd would (paths, port and model swapped for this machine's): turn 2 is cached."""
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    llama_port, proxy_port = free_port(), free_port()
    unit = unit_settings(TEMPLATE)
    env = dict(v.split("=", 1) for v in unit["Environment"])
    env.update(LLAMA_MODEL=str(bundled_model()), LLAMA_CTX_SIZE="4096")
    words = [w for word in unit["ExecStart"][0].split() for w in expand(word, env)]
    words = [str(cache) if w == CACHE_DIR else w.replace("%i", str(llama_port)) for w in words]
    words[0] = str(find_server_binary(None))

    proxy_env = {k: v for k, v in os.environ.items() if not k.startswith("KVPROXY_")}
    proxy_env.update(active_env())
    proxy_env.update(
        KVPROXY_UPSTREAM=f"http://127.0.0.1:{llama_port}",
        KVPROXY_CACHE_DIR=str(cache),
        KVPROXY_PORT=str(proxy_port),
    )
    kv_words = unit_settings("kvproxy.service")["ExecStart"][0].split()
    kv_words[0] = str(kvproxy_bin())

    llama_log, proxy_log = tmp_path / "llama.log", tmp_path / "kvproxy.log"
    # Through the start-up path the test suite shares: on a CPU where this binary needs
    # --no-repack (deploy/README.md: LLAMA_EXTRA_ARGS), it is added as the unit would get it.
    llama = run_server_command(words, llama_port, llama_log)
    with open(proxy_log, "wb") as out:
        proxy = subprocess.Popen(kv_words, env=proxy_env, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{proxy_port}", proxy, proxy_log)
        messages = [{"role": "user", "content": "Say hello."}]
        verdicts = []
        for _ in range(2):
            verdict, reply = chat(
                f"http://127.0.0.1:{proxy_port}", {"messages": messages, "max_tokens": 8}
            )
            verdicts.append(verdict)
            answer = reply["choices"][0]["message"]["content"]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "Again."},
            ]
        assert verdicts[1] in ("resident", "restored"), (verdicts, proxy_log.read_text())
    finally:
        proxy.terminate()
        try:
            proxy.wait(30)
        except subprocess.TimeoutExpired:
            proxy.kill()
            proxy.wait()
        server_loop().run(llama.stop(grace=30))
