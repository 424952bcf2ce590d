"""deploy/grafana/kvproxy.json: every PromQL query names only metrics kvproxy really exports
(read off a live /metrics scrape of a proxy on the fake server, with the suffixes Prometheus
sees: _total, _bucket, _sum, _count) and groups or filters only by labels those metrics have."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from .conftest import Maker
from .test_cache import chat, conv, settle, then
from .test_metrics import scrape

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "kvproxy.json"
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"instance", "job"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count")}
# PromQL's own words, and Grafana's variables ($__rate_interval, $instance, ...).
PROMQL = {
    "sum", "max", "min", "avg", "count", "by", "without", "rate", "increase", "irate",
    "histogram_quantile", "label_values", "le", "bool", "and", "or", "unless", "on", "ignoring",
}  # fmt: skip


def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for item in items:
        yield item
        yield from panels(item.get("panels", []))


def queries(dashboard: dict[str, Any]) -> list[str]:
    found = [t["expr"] for p in panels(dashboard["panels"]) for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]
            found.append(query["query"] if isinstance(query, dict) else query)
    return found


def exported(text: str) -> dict[str, set[str]]:
    """Every series name the scrape shows (a family with no sample yet counts by its type's
    suffixes), each with the labels it has."""
    names: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for suffix in SUFFIXES.get(family.type, ("",)):
            names.setdefault(family.name + suffix, set())
        for sample in family.samples:
            names.setdefault(sample.name, set()).update(sample.labels)
    hist_labels = {n.removesuffix("_bucket"): lb for n, lb in names.items() if "le" in lb}
    for base, labels in hist_labels.items():  # _sum and _count carry the same labels but le
        for suffix in ("_sum", "_count", "_bucket"):
            names[base + suffix] |= labels | ({"le"} if suffix == "_bucket" else set())
    return names


def strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


async def test_every_dashboard_query_names_an_exported_metric(make: Maker) -> None:
    fake, proxy = await make()
    replies = {c: (await chat(proxy, conv(c)))[1] for c in (1, 2, 3)}
    await settle(proxy)
    await chat(proxy, then(conv(1), replies[1]))  # a restore: the action histograms fill
    await settle(proxy)
    # A background fault, as a full disk would give, and its end: the fault series appear.
    proxy.cache.faults.failed("housekeeping", OSError(28, "No space left on device"))
    proxy.cache.faults.succeeded("housekeeping")
    status, text = await scrape(proxy)
    assert status == 200
    names = exported(text)
    assert "kvproxy_slot_action_seconds_bucket" in names and "kvproxy_requests_total" in names

    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] == "kvproxy" and dashboard["uid"] == "kvproxy"
    exprs = queries(dashboard)
    assert len(exprs) >= 20
    used: set[str] = set()
    for expr in exprs:
        bare = strip_strings(expr)
        metrics = set(re.findall(r"\bkvproxy_[a-z0-9_]+", bare))
        assert metrics, f"names no kvproxy metric: {expr}"
        unknown = metrics - set(names)
        assert not unknown, f"{expr}\nnames metrics kvproxy does not export: {unknown}"
        used |= metrics
        # Anything else that reads as a metric name is PromQL's, or a Grafana variable.
        words = set(re.findall(r"(?<![$\w])[a-zA-Z_][a-zA-Z0-9_]*", bare)) - metrics
        labels = {lb for m in metrics for lb in names[m]} | TARGET_LABELS
        stray = words - PROMQL - labels
        assert not stray, f"{expr}\nnames what is neither PromQL nor a label: {stray}"
        for group in re.findall(r"\bby \(([^)]*)\)", bare):
            for label in (g.strip() for g in group.split(",")):
                assert label in labels, f"{expr}\ngroups by {label!r}, a label none has"
    # The list: decisions, tokens from cache, prefill saved, save/restore latency,
    # queue depth, disk bytes, weak hits, namespaces, background faults.
    for wanted in (
        "kvproxy_requests_total",
        "kvproxy_tokens_cached_total",
        "kvproxy_prefill_seconds_saved_total",
        "kvproxy_slot_action_seconds_bucket",
        "kvproxy_queue_depth",
        "kvproxy_cache_bytes",
        "kvproxy_weak_hits_total",
        "kvproxy_namespaces",
        "kvproxy_background_failing",
    ):
        assert wanted in used, f"the dashboard does not show {wanted}"


def test_the_dashboard_imports_cleanly() -> None:
    """What Grafana's import needs: unique panel ids, grid positions inside 24 columns, a
    Prometheus datasource picked by a variable (no datasource uid of one installation)."""
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    for p in panels(dashboard["panels"]):
        pos = p["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}"
    [ds] = [v for v in dashboard["templating"]["list"] if v["type"] == "datasource"]
    assert ds["query"] == "prometheus"
