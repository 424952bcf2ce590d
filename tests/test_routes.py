"""The positive route model (edge/routes.py): kvproxy forwards only the routes it knows for
this server build; everything else is a 404 unless the operator allows it with --allow-route.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from kvproxy.cli.flags import add_settings_flags, settings_from_args
from kvproxy.edge import routes
from kvproxy.edge.routes import ROUTES, RouteTable, Treatment
from kvproxy.server.managed import free_port

from .conftest import Maker, RunningProxy, start_proxy, start_real_server
from .test_cache import chat, conv, settle
from .test_proxy import EchoUpstream

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
async def echo() -> AsyncIterator[EchoUpstream]:
    upstream = EchoUpstream()
    await upstream.start()
    yield upstream
    await upstream.runner.cleanup()


@pytest.fixture
async def proxy(echo: EchoUpstream, tmp_path: Path) -> AsyncIterator[RunningProxy]:
    running = await start_proxy(echo.url, tmp_path / "cache")
    yield running
    await running.stop()


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/models"),  # router mode: downloads a repository the client names
        ("DELETE", "/models"),
        ("POST", "/models/load"),
        ("POST", "/models/unload"),
        ("POST", "/v1/chat/completions/control"),
        ("POST", "/cors-proxy"),
        ("GET", "/cors-proxy?url=http://169.254.169.254/"),
        ("POST", "/tools"),
        ("GET", "/tools"),
        ("POST", "/llm/tools"),  # under an --api-prefix too
        ("POST", "/predict"),
        ("POST", "/props"),
        ("POST", "/lora-adapters"),
        ("GET", "/slots"),
        ("OPTIONS", "/slots/0"),
        ("GET", "/v1/stream?conv_id=x"),
        ("POST", "/v1/streams/lookup"),
    ],
)
async def test_dangerous_routes_are_refused(
    echo: EchoUpstream, proxy: RunningProxy, method: str, path: str
) -> None:
    async with aiohttp.ClientSession() as s, s.request(method, proxy.url + path) as resp:
        assert resp.status == 403, await resp.text()
        body = await resp.json()
        assert body["error"]["code"] == "forbidden_route"
    assert not echo.seen


@pytest.mark.parametrize(
    ("method", "path"),
    [
        # The sidecar's server has AIP_PREDICT_ROUTE=/v2/infer, kvproxy's environment not.
        ("POST", "/v2/infer?id_slot=0&action=erase"),
        ("POST", "/v2/infer?id_slot=0&action=save&filename=evil.kv"),
        ("POST", "/some/future/route"),
        ("GET", "/v1/chat/completions"),  # a known path, but not a method the server has
        ("PUT", "/tokenize"),
        ("GET", "/index.php"),
    ],
)
async def test_routes_not_in_the_table_are_404(
    echo: EchoUpstream, proxy: RunningProxy, method: str, path: str
) -> None:
    async with aiohttp.ClientSession() as s, s.request(method, proxy.url + path) as resp:
        assert resp.status == 404, await resp.text()
        body = await resp.json()
        assert body["error"]["code"] == "not_found"
        assert "--allow-route" in body["error"]["message"]
    assert not echo.seen


PASS_ROUTES = [
    (method, r.path)
    for r in ROUTES
    if r.treatment is Treatment.PASS
    for method in sorted(r.methods)
    if r.path not in ("/props",)  # the proxy's own discovery answers GET /props on EchoUpstream
]


@pytest.mark.parametrize(("method", "path"), PASS_ROUTES)
async def test_every_pass_route_in_the_table_reaches_the_server(
    echo: EchoUpstream, proxy: RunningProxy, method: str, path: str
) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.request(method, proxy.url + path + "?q=1", data=b"x") as resp:
            assert resp.status == 207, await resp.text()
    assert echo.seen[0]["method"] == method
    assert echo.seen[0]["path_qs"] == path + "?q=1"


async def test_read_only_model_routes_pass(echo: EchoUpstream, proxy: RunningProxy) -> None:
    async with aiohttp.ClientSession() as s:
        for path in ("/models", "/models/sse", "/v1/models"):
            async with s.get(proxy.url + path) as resp:
                assert resp.status == 207
        async with s.head(proxy.url + "/health") as resp:  # a GET route answers HEAD
            assert resp.status == 207
    assert [e["path_qs"] for e in echo.seen] == ["/models", "/models/sse", "/v1/models", "/health"]


async def test_allow_route_opens_a_path_or_a_prefix_but_never_a_refusal(
    echo: EchoUpstream, tmp_path: Path
) -> None:
    running = await start_proxy(
        echo.url, tmp_path / "cache", allow_route=["/v2/infer", "/llm/*", "/slots"]
    )
    try:
        async with aiohttp.ClientSession() as s:
            for method, path in (
                ("POST", "/v2/infer"),
                ("GET", "/llm/health"),
                ("POST", "/llm/v1/chat/completions"),
            ):
                async with s.request(method, running.url + path, data=b"{}") as resp:
                    assert resp.status == 207, (path, await resp.text())
            for path in ("/llm/slots/0?action=erase", "/slots", "/llm/models/load"):
                async with s.post(running.url + path) as resp:
                    assert resp.status == 403, path
            async with s.post(running.url + "/v2/other") as resp:
                assert resp.status == 404
    finally:
        await running.stop()
    assert [e["path_qs"] for e in echo.seen] == [
        "/v2/infer",
        "/llm/health",
        "/llm/v1/chat/completions",
    ]


def test_allow_route_is_a_repeatable_flag() -> None:
    parser = argparse.ArgumentParser()
    add_settings_flags(parser)
    args = parser.parse_args(
        ["--allow-route", "/v2/infer", "--allow-route", "/a/../b/*,/c/", "--upstream", "http://x"]
    )
    assert settings_from_args(args).allow_route == ["/v2/infer", "/b/*", "/c"]
    help_text = parser.format_help()
    assert "--allow-route" in help_text and "404" in help_text
    with pytest.raises(SystemExit):
        settings_from_args(parser.parse_args(["--allow-route", "v2/infer"]))


def test_a_refused_allowance_is_reported() -> None:
    table = RouteTable(["/slots/*", "/models/load", "/v2/infer"])
    assert table.refused_allowances() == ["/slots/*", "/models/load"]


def test_every_keyed_route_names_an_api_the_app_reads() -> None:
    from kvproxy.edge.app import adapters

    table, known = RouteTable(), adapters(keep_reasoning=False)
    keyed = routes.paths(Treatment.KEYED)
    assert {"/v1/chat/completions", "/v1/messages", "/v1/responses", "/completion"} <= keyed
    assert {"/v1/completions", "/infill"} <= keyed
    for path in keyed:
        decision = table.decide("POST", path)
        assert decision.treatment is Treatment.KEYED and decision.api in known
    for path in routes.paths(Treatment.EVERY_SLOT):
        assert table.decide("POST", path).api == ""


def test_docs_route_table_is_generated_from_the_module() -> None:
    """docs/routes.md is `python -m kvproxy.edge.routes`; regenerate it when the table moves."""
    assert (ROOT / "docs" / "routes.md").read_text() == routes.markdown()
    readme = (ROOT / "README.md").read_text()
    assert "--allow-route" in readme and "docs/routes.md" in readme


@pytest.mark.real
async def test_a_predict_route_only_the_sidecar_server_knows_is_closed(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/'s units: the server runs with AIP_PREDICT_ROUTE=/v2/infer, kvproxy without it."""
    port = free_port()
    monkeypatch.setenv("AIP_MODE", "PREDICTION")
    monkeypatch.setenv("AIP_HTTP_PORT", str(port))
    monkeypatch.setenv("AIP_PREDICT_ROUTE", "/v2/infer")
    server = await asyncio.to_thread(start_real_server, cache_dir, port=port)
    for name in ("AIP_MODE", "AIP_HTTP_PORT", "AIP_PREDICT_ROUTE"):
        monkeypatch.delenv(name)
    try:
        proxy = await start_proxy(server.url, cache_dir)
        erase = {"instances": [{"@requestFormat": "/slots/:id_slot"}]}
        try:
            async with aiohttp.ClientSession() as s:
                async with s.post(server.url + "/v2/infer?id_slot=0&action=erase", json=erase) as r:
                    assert r.status == 200  # the server alone runs the slot action
                for action in ("erase", "save&filename=evil.kv"):
                    url = proxy.url + f"/v2/infer?id_slot=0&action={action}"
                    async with s.post(url, json=erase) as r:
                        assert r.status == 404, await r.text()
            assert not (cache_dir / "evil.kv").exists()
        finally:
            await proxy.stop()
    finally:
        await asyncio.to_thread(server.stop)


async def test_model_management_is_refused_unless_the_operator_allows_it(make: Maker) -> None:
    """A client cannot make a router-mode server download (`POST /models`), delete
    (`DELETE /models`), load or unload a model through kvproxy; with
    --allow-model-management it can, and what the slots held is saved first."""
    fake, proxy = await make()
    async with aiohttp.ClientSession() as s:
        for method, path in MANAGEMENT:
            async with s.request(method, proxy.url + path, json={"model": "x"}) as r:
                assert r.status == 403, (method, path)
    assert not [p for _, p, _ in fake.requests if p.startswith("/models")]

    fake, proxy = await make(allow_model_management=True)
    _, r1, _ = await chat(proxy, conv(1))  # an unsaved conversation in a slot
    await settle(proxy)
    async with aiohttp.ClientSession() as s:
        async with s.post(proxy.url + "/models/unload", json={"model": "x"}) as r:
            assert r.status == 404  # the fake has no router: its own answer, passed on
    sent = [p for _, p, _ in fake.requests]
    assert "/models/unload" in sent
    saved_at = max(i for i, p in enumerate(sent) if p.endswith("action=save"))
    assert saved_at < sent.index("/models/unload"), "saved before the model could go"
    assert proxy.cache.store.entries


MANAGEMENT = [
    ("POST", "/models"),
    ("DELETE", "/models"),
    ("POST", "/models/load"),
    ("POST", "/models/unload"),
]
