"""The router's rules, splits and health (payorch.routing), and a routing table refused at
start-up in one line: the pure side, no provider called."""

from __future__ import annotations

import json
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from payorch.cli import _app
from payorch.errors import ConfigurationError, NoRoute
from payorch.execution._executor import Executor
from payorch.migrate import upgrade
from payorch.operations import default_registry
from payorch.provider import AnswerKind
from payorch.providers.sandbox import SandboxProvider
from payorch.routing import HealthPolicy, Router, Rule, load_router, router_from_mapping
from payorch.storage._store import Store

EUR = {"amount": 1000, "currency": "EUR", "customer": "c"}


def choose(router: Router, key: str = "k", **over: Any) -> tuple[str, ...]:
    args: dict[str, Any] = {
        "tenant_id": "shop",
        "operation": "payment.create",
        "idempotency_key": key,
        "request": EUR,
        "amount": 1000,
        "currency": "EUR",
    }
    args.update(over)
    return router.choose(**args).providers


def test_rules_match_by_currency_amount_tenant_and_fields_first_match_wins() -> None:
    router = Router(
        [
            Rule(operation="payment.create", providers=["b", "a"], tenants=["vip"]),
            Rule(operation="payment.create", providers=["c"], currencies=["usd"]),
            Rule(operation="payment.create", providers=["a"], min_amount=0, max_amount=999),
            Rule(
                operation="payment.create",
                providers=["b"],
                fields={"metadata.network": ["visa", "mc"]},
            ),
            Rule(operation="payment.create", providers=["a", "b"]),
        ],
        health=None,
    )
    assert choose(router, tenant_id="vip") == ("b", "a")
    assert choose(router, currency="USD") == ("c",)
    assert choose(router, amount=999) == ("a",)
    visa = {**EUR, "metadata": {"network": "visa"}}
    assert choose(router, request=visa) == ("b",)
    assert choose(router, request={**EUR, "metadata": {"network": "amex"}}) == ("a", "b")
    assert not router.routes("refund.create")


def test_a_request_no_rule_matches_is_a_422_naming_the_operation_type() -> None:
    router = Router([Rule(operation="payment.create", providers=["a"], currencies=["EUR"])])
    with pytest.raises(NoRoute) as caught:
        choose(router, currency="GBP")
    assert caught.value.http_status == 422
    assert "'payment.create'" in caught.value.message and "\n" not in caught.value.message


def test_a_split_is_stable_per_namespace_and_follows_its_shares() -> None:
    rule = Rule(operation="payment.create", providers=["a", "b"], split={"a": 70, "b": 30})
    router = Router([rule], health=None)
    firsts = Counter(choose(router, key=f"order-{i}")[0] for i in range(4000))
    assert 0.64 < firsts["a"] / 4000 < 0.76
    # A retry (the same namespace) draws the same first provider; the other follows.
    for i in range(50):
        route = choose(router, key=f"order-{i}")
        assert choose(router, key=f"order-{i}") == route and set(route) == {"a", "b"}


@given(st.lists(st.integers(min_value=0, max_value=100), min_size=2, max_size=4))
def test_a_split_that_does_not_add_up_to_100_is_refused(shares: list[int]) -> None:
    names = [f"p{i}" for i in range(len(shares))]
    rule = Rule(
        operation="payment.create", providers=names, split=dict(zip(names, shares, strict=True))
    )
    if sum(shares) == 100:
        Router([rule]).check(names)
    else:
        with pytest.raises(ConfigurationError, match="adds up to"):
            Router([rule]).check(names)


@pytest.mark.parametrize(
    ("rule", "says"),
    [
        ({"providers": ["a", "ghost"]}, "unknown provider 'ghost'"),
        ({"providers": []}, "names no provider"),
        ({"providers": ["a", "a"]}, "names a provider twice"),
        ({"providers": ["a", "b"], "split": {"a": 120, "b": -20}}, "must be 0-100"),
        ({"providers": ["a", "b"], "split": {"a": 50, "c": 50}}, "not one of its providers"),
        ({"providers": ["a"], "min_amount": 10, "max_amount": 5}, "above max_amount"),
    ],
)
def test_a_rule_that_cannot_route_refuses_start_up_in_one_line(
    rule: dict[str, Any], says: str, tmp_path: Path
) -> None:
    store = Store.from_url(f"sqlite:///{tmp_path / 'x.db'}")
    router = Router([Rule(operation="payment.create", **rule)])
    adapters = [
        SandboxProvider(base_url="http://127.0.0.1:1", name="a"),
        SandboxProvider(base_url="http://127.0.0.1:1", name="b"),
    ]
    try:
        with pytest.raises(ConfigurationError) as caught:
            Executor(store=store, providers=adapters, registry=default_registry("a"), router=router)
    finally:
        for adapter in adapters:
            adapter.close()
        store.close()
    assert says in caught.value.message and "\n" not in caught.value.message


def test_an_unhealthy_provider_is_passed_over_for_a_while_then_tried_again() -> None:
    now = [0.0]
    policy = HealthPolicy(
        window=timedelta(seconds=60), min_calls=4, failure_ratio=0.5, cool_off=timedelta(seconds=30)
    )
    router = Router(
        [Rule(operation="payment.create", providers=["a", "b"])],
        health=policy,
        clock=lambda: now[0],
    )
    for kind in (AnswerKind.NOT_SENT, AnswerKind.SUCCEEDED, AnswerKind.AMBIGUOUS):
        router.health.observe("a", kind)
    assert choose(router) == ("a", "b")  # three calls: too few to judge
    router.health.observe("a", AnswerKind.NOT_SENT)
    chosen = router.choose(
        tenant_id="shop",
        operation="payment.create",
        idempotency_key="k",
        request=EUR,
        amount=1000,
        currency="EUR",
    )
    # Passed over, not dropped: still the last resort if the others prove not executed.
    assert chosen.providers == ("b", "a") and chosen.skipped == ("a",)
    now[0] = 31.0
    assert choose(router) == ("a", "b")
    # Declines are answers: a provider that declines is healthy.
    for _ in range(10):
        router.health.observe("b", AnswerKind.DECLINED)
    assert router.health.healthy("b")


def test_a_routing_table_file_is_read_or_refused_in_one_line(tmp_path: Path) -> None:
    toml = tmp_path / "routing.toml"
    toml.write_text(
        'fallback_declines = ["issuer_unavailable"]\n'
        "[health]\nmin_calls = 3\n"
        '[[rules]]\nname = "eu"\noperation = "payment.create"\nproviders = ["a", "b"]\n'
        'split = { a = 60, b = 40 }\ncurrencies = ["EUR"]\n'
    )
    router = load_router(toml)
    router.check({"a", "b"})
    assert router.fallback_declines == {"issuer_unavailable"}
    assert router.health.policy.min_calls == 3 and router.rules[0].label == "eu"
    as_json = tmp_path / "routing.json"
    as_json.write_text(json.dumps({"rules": [{"operation": "payment.create", "providers": 1}]}))
    with pytest.raises(ConfigurationError) as caught:
        load_router(as_json)
    assert "rules.0.providers" in caught.value.message and "\n" not in caught.value.message
    with pytest.raises(ConfigurationError, match=r"unknown|Extra"):
        router_from_mapping({"rules": [], "surprise": True})
    broken = tmp_path / "broken.toml"
    broken.write_text("[[rules]\n")
    with pytest.raises(ConfigurationError, match="not valid toml"):
        load_router(broken)


def test_routing_check_shows_the_table_or_refuses_it_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAYORCH_PROVIDERS", raising=False)
    good = tmp_path / "good.json"
    good.write_text(
        json.dumps({"rules": [{"operation": "payment.create", "providers": ["sandbox"]}]})
    )
    runner = CliRunner()
    result = runner.invoke(_app.app, ["routing", "check", "--file", str(good)])
    assert result.exit_code == 0, result.output
    assert "payment.create" in result.output and "none (a decline is final)" in result.output
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rules": [{"operation": "payment.create", "providers": ["x"]}]}))
    monkeypatch.setenv("PAYORCH_ROUTING", str(bad))
    result = runner.invoke(_app.app, ["routing", "check"])
    assert result.exit_code == 1
    assert "unknown provider 'x'" in result.output and "Traceback" not in result.output


def test_the_daemon_refuses_a_routing_table_it_cannot_serve_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PAYORCH_PROVIDERS", raising=False)
    bad = tmp_path / "routing.json"
    bad.write_text(
        json.dumps(
            {
                "rules": [
                    {
                        "operation": "payment.create",
                        "providers": ["sandbox", "acquirer_z"],
                        "split": {"sandbox": 50, "acquirer_z": 50},
                    }
                ]
            }
        )
    )
    monkeypatch.setenv("PAYORCH_ROUTING", str(bad))
    url = f"sqlite:///{tmp_path / 'daemon.db'}"
    upgrade(url)
    result = CliRunner().invoke(
        _app.app, ["reconcile", "run", "--database-url", url, "--metrics-addr", "off"]
    )
    assert result.exit_code == 1
    assert "unknown provider 'acquirer_z'" in result.output
    assert "started" not in result.output and "Traceback" not in result.output
