"""docs/grafana/payorch.json queries only series payorch exports, with labels they carry.

Every PromQL expression of every panel (and every ``label_values`` of a variable) is read by
a small tokenizer: the metric names (``payorch_…``), the labels of each selector's matchers,
and the labels of ``by (…)``/``without (…)``. Each name must resolve to a series of
``payorch.metrics.registry`` after exercising it (an execution, a refusal, reconciler,
webhook, outbox and effect counts, and the state gauges of a watched PostgreSQL store, whose
replication gauges exist only there), by the exposition's rules: a counter is queried as
``<name>_total``, a histogram as ``_bucket``/``_sum``/``_count`` (``le`` on ``_bucket`` only),
a gauge by its name.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from payorch import Executor, Store, metrics
from payorch.errors import IdempotencyKeyReused
from payorch.observing import _metrics
from payorch.once import _metrics as once_metrics
from payorch.operations import default_registry
from payorch.provider import Answer, AnswerKind

DASHBOARD = Path(__file__).resolve().parent.parent / "docs" / "grafana" / "payorch.json"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_RANGE = re.compile(r"\[[^\]]*\]")
_SELECTOR = re.compile(r"\b(payorch_[a-z0-9_]+)\b\s*(\{[^}]*\})?")
_MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_LABEL_VALUES = re.compile(r"label_values\(\s*([^,()]+?)\s*,\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)")


@dataclass
class Query:
    """What one expression asks of the registry."""

    selectors: dict[str, set[str]] = field(default_factory=dict)  # name -> matcher labels
    grouping: set[str] = field(default_factory=set)  # by/without/on/ignoring labels


def parse(expr: str) -> Query:
    """The metric names and labels of a PromQL expression (strings and ranges dropped
    first, so a label value or ``[$__rate_interval]`` is never read as a name)."""
    bare = _RANGE.sub("", _STRING.sub('""', expr))
    query = Query()
    for name, selector in _SELECTOR.findall(bare):
        query.selectors.setdefault(name, set()).update(_MATCHER.findall(selector or ""))
    for labels in _GROUPING.findall(bare):
        query.grouping.update(part.strip() for part in labels.split(",") if part.strip())
    return query


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expression) of every panel target (rows' nested panels too) and variable."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        for panel in panels:
            for target in panel.get("targets", []):
                yield panel["title"], target["expr"]
            yield from walk(panel.get("panels", []))

    yield from walk(dashboard["panels"])
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            text = variable["definition"]
            for metric, label in _LABEL_VALUES.findall(text):
                yield f"${variable['name']}", f"sum by ({label}) ({metric})"


@dataclass(frozen=True)
class Family:
    type: str
    samples: dict[str, set[str]]  # sample name -> the labels its samples carry


def families() -> dict[str, Family]:
    assert metrics.registry is not None
    found: dict[str, Family] = {}
    for family in metrics.registry.collect():
        samples: dict[str, set[str]] = {}
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
        found[family.name] = Family(family.type, samples)
    return found


SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def resolve(name: str, known: dict[str, Family]) -> set[str]:
    """The labels of the series ``name`` selects, by the exposition's naming rules; an
    AssertionError when no exported series has that name."""
    gauge = known.get(name)
    if gauge is not None and gauge.type == "gauge":
        assert name in gauge.samples, f"{name}: a gauge with no value (not exercised)"
        return gauge.samples[name]
    for kind, suffixes in SUFFIXES.items():
        for suffix in suffixes:
            base = name.removesuffix(suffix)
            family = known.get(base)
            if base != name and family is not None and family.type == kind:
                assert name in family.samples, f"{name}: no series yet (not exercised)"
                return family.samples[name]
    hint = f" ({known[name].type}: add its suffix)" if name in known else ""
    raise AssertionError(f"{name}: payorch exports no such series{hint}")


def problems(dashboard: dict[str, Any], known: dict[str, Family]) -> list[str]:
    found = []
    for where, expr in expressions(dashboard):
        query = parse(expr)
        if not query.selectors:
            found.append(f"{where}: no payorch metric in {expr!r}")
        for name, matched in query.selectors.items():
            try:
                labels = resolve(name, known)
            except AssertionError as exc:
                found.append(f"{where}: {exc}")
                continue
            # A grouping label must exist on every series the expression aggregates.
            for label in sorted((matched | query.grouping) - labels):
                found.append(f"{where}: {name} has no label {label!r}")
    return found


class Instant:
    """A provider answering at once, in this process (nothing to serve)."""

    name = "instant"
    idempotency_window = timedelta(hours=24)
    max_call_duration = timedelta(milliseconds=10)

    def submit(self, request: Any) -> Answer:
        return Answer(kind=AnswerKind.SUCCEEDED, provider_reference="ref_1")

    def query_status(self, query: Any) -> Answer:
        return Answer(kind=AnswerKind.SUCCEEDED, provider_reference="ref_1")

    def parse_webhook(self, headers: Any, body: bytes) -> Any:
        raise NotImplementedError


@pytest.fixture
def exercised(postgres_url: str) -> Iterator[dict[str, Family]]:
    """The registry after one execution, one refusal, the counts the reconciler, webhook
    handler, relay and effects make, and a watched PostgreSQL store."""
    store = Store.from_url(postgres_url)
    try:
        executor = Executor(
            store=store, providers=[Instant()], registry=default_registry("instant")
        )
        request = {"amount": 5, "currency": "EUR", "customer": "c"}
        call = {"tenant_id": "t", "operation": "payment.create", "idempotency_key": "k"}
        executor.execute(**call, request=request)
        with pytest.raises(IdempotencyKeyReused):
            executor.execute(**call, request={**request, "amount": 6})
        _metrics.for_provider("instant").retried()
        _metrics.checked("succeeded")
        _metrics.escalated("max_checks")
        _metrics.pass_finished("ok")
        _metrics.webhook_counted("instant", "applied")
        _metrics.delivery("orders", "delivered", 0.01)
        once_metrics.counted("emails", "fresh")
        metrics.watch(store)
        yield families()
    finally:
        assert metrics.registry is not None
        for gauges in list(_metrics._watched):
            metrics.registry.unregister(gauges)
        _metrics._watched.clear()
        store.close()


def test_every_series_the_dashboard_queries_exists_with_its_labels(
    exercised: dict[str, Family],
) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert problems(dashboard, exercised) == []
    queried = {name for _, expr in expressions(dashboard) for name in parse(expr).selectors}
    # The panels the dashboard promises are there.
    for name in (
        "payorch_executions_total",
        "payorch_operations",
        "payorch_needs_attention_operations",
        "payorch_provider_call_duration_seconds_bucket",
        "payorch_reconciler_passes_total",
        "payorch_webhooks_total",
        "payorch_outbox_messages",
        "payorch_outbox_deliveries_total",
        "payorch_effects_needs_attention",
        "payorch_database_replication_mode",
    ):
        assert name in queried, name


def test_the_dashboard_is_an_importable_grafana_model() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["schemaVersion"] >= 39 and dashboard["uid"] == "payorch"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"] and all(t["expr"] for t in panel["targets"]), panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["x"] + grid["w"] <= 24, panel["title"]


@pytest.mark.parametrize(
    ("expr", "selectors", "grouping"),
    [
        (
            'sum by (provider) (rate(payorch_webhooks_total{status="applied", '
            'provider=~"$provider"}[$__rate_interval]))',
            {"payorch_webhooks_total": {"status", "provider"}},
            {"provider"},
        ),
        # A label value that looks like a metric name is a string, not a series.
        ('up{job="payorch_reconciler"} == 0', {}, set()),
        (
            "histogram_quantile(0.99, sum by (le, call) "
            "(rate(payorch_provider_call_duration_seconds_bucket[5m])))",
            {"payorch_provider_call_duration_seconds_bucket": set()},
            {"le", "call"},
        ),
        (
            "time() - max without (instance) (payorch_reconciler_last_pass_timestamp_seconds)",
            {"payorch_reconciler_last_pass_timestamp_seconds": set()},
            {"instance"},
        ),
    ],
)
def test_the_tokenizer_reads_names_and_labels(
    expr: str, selectors: dict[str, set[str]], grouping: set[str]
) -> None:
    query = parse(expr)
    assert query.selectors == selectors and query.grouping == grouping


def test_the_suffix_rules_refuse_a_wrong_spelling() -> None:
    known = {
        "payorch_executions": Family("counter", {"payorch_executions_total": {"result"}}),
        "payorch_claim_duration_seconds": Family(
            "histogram",
            {
                "payorch_claim_duration_seconds_bucket": {"le"},
                "payorch_claim_duration_seconds_sum": set(),
            },
        ),
        "payorch_operations": Family("gauge", {"payorch_operations": {"state"}}),
    }
    assert resolve("payorch_executions_total", known) == {"result"}
    assert resolve("payorch_claim_duration_seconds_bucket", known) == {"le"}
    assert resolve("payorch_claim_duration_seconds_sum", known) == set()
    assert resolve("payorch_operations", known) == {"state"}
    for wrong in (
        "payorch_executions",  # a counter's series end in _total
        "payorch_claim_duration_seconds",  # a histogram has no bare series
        "payorch_claim_duration_seconds_total",
        "payorch_operations_total",  # a gauge has no _total
        "payorch_executions_bucket",
    ):
        with pytest.raises(AssertionError):
            resolve(wrong, known)
    # A histogram's le is on _bucket only: grouping _sum by le is reported.
    dashboard = {
        "panels": [
            {
                "title": "p",
                "targets": [{"expr": "sum by (le) (payorch_claim_duration_seconds_sum)"}],
            }
        ],
        "templating": {"list": []},
    }
    assert problems(dashboard, known) == ["p: payorch_claim_duration_seconds_sum has no label 'le'"]
