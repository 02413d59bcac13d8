"""Fingerprints are the same in every process, and NaN/inf are refused as bad input.

A ``set`` in an effect field dumps to JSON in hash order, which ``PYTHONHASHSEED`` changes
from process to process: the same request got another fingerprint in each worker. Such
types are refused when the operation type is registered; one smuggled in at run time
(through ``Any``) is refused with the request.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import pytest
import sqlalchemy as sa
from pydantic import BaseModel, Field
from typing_extensions import TypedDict  # pydantic wants it before Python 3.12

from payorch.errors import ConfigurationError, InvalidRequest, UnencodableRequest
from payorch.execution._executor import Executor
from payorch.operations import OperationType, Registry
from payorch.providers.sandbox import SandboxServer
from payorch.storage._store import Store
from payorch.storage._tables import events, operations

# Run in a fresh interpreter per hash seed. It registers a set-typed type (expected to be
# refused), fingerprints ordinary effects (dicts, lists, nested models) and smuggles a set
# through ``Any`` (expected to be refused); it prints one JSON line of what it saw.
_CHILD = textwrap.dedent(
    """
    import json
    from typing import Any
    from pydantic import BaseModel
    from payorch.errors import ConfigurationError, UnencodableRequest
    from payorch.operations import OperationType, default_registry

    class Tagged(BaseModel):
        amount: int
        tags: set[str]

    class Line(BaseModel):
        sku: str
        quantity: int

    class Basket(BaseModel):
        amount: int
        lines: list[Line]
        labels: dict[str, str]
        extra: Any = None

    TAGS = [f"tag-{i}" for i in range(32)]
    seen = {}
    try:
        OperationType(name="tagged.pay", model=Tagged, effect_fields=("amount", "tags"))
        seen["set_type"] = "registered"
    except ConfigurationError as exc:
        seen["set_type"] = "refused: " + str(exc)

    reg = default_registry("sandbox")
    reg.register(
        OperationType(
            name="basket.pay",
            model=Basket,
            effect_fields=("amount", "lines", "labels", "extra"),
            provider="sandbox",
        )
    )

    def fp(request):
        return reg.prepare(
            tenant_id="t", operation="basket.pay", idempotency_key="k", request=request
        ).new.fingerprint

    labels = {t: t.upper() for t in TAGS}
    lines = [{"sku": t, "quantity": i} for i, t in enumerate(TAGS)]
    seen["basket"] = fp({"amount": 5, "lines": lines, "labels": labels})
    seen["basket_reordered"] = fp(
        {"labels": dict(reversed(labels.items())), "lines": lines, "amount": 5}
    )
    seen["payment"] = reg.prepare(
        tenant_id="t",
        operation="payment.create",
        idempotency_key="k",
        request={"amount": 1, "currency": "EUR", "metadata": labels},
    ).new.fingerprint
    try:
        fp({"amount": 5, "lines": [], "labels": {}, "extra": {"tags": set(TAGS)}})
        seen["smuggled_set"] = "accepted"
    except UnencodableRequest as exc:
        seen["smuggled_set"] = "refused: " + str(exc)
    print(json.dumps(seen))
    """
)

SEEDS = ["0", "1", "2", "3", "12345"]


@pytest.mark.slow
def test_fingerprints_agree_across_hash_seeds_and_set_types_are_refused() -> None:
    results = []
    for seed in SEEDS:
        env = {**os.environ, "PYTHONHASHSEED": seed}
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for seen in results:
        assert seen["set_type"].startswith("refused: ")
        assert "tags" in seen["set_type"]
        assert seen["smuggled_set"].startswith("refused: ")
        assert seen["basket"] == seen["basket_reordered"]
    # One fingerprint per request, whatever the process's hash seed.
    assert len({seen["basket"] for seen in results}) == 1
    assert len({seen["payment"] for seen in results}) == 1


class _Nested(BaseModel):
    codes: frozenset[int]


@dataclass
class _Dc:
    members: set[str]


class _Td(TypedDict):
    names: set[str]


@pytest.mark.parametrize(
    "annotation",
    [
        set[str],
        frozenset[int],
        Optional[set[str]],  # noqa: UP045 - the typing spelling is what is under test
        set[str] | None,
        list[set[str]],
        dict[str, frozenset[str]],
        tuple[int, set[int]],
        _Nested,
        list[_Nested] | None,
        _Dc,
        _Td,
    ],
)
def test_registration_refuses_set_types_anywhere_in_an_effect_field(annotation: Any) -> None:
    model = _model_with(annotation)
    with pytest.raises(ConfigurationError, match="is a set"):
        OperationType(name="odd.pay", model=model, effect_fields=("amount", "field"))


def test_sets_outside_the_effect_fields_are_allowed() -> None:
    # They never reach the fingerprint; the stored request's order does not matter.
    model = _model_with(set[str])
    reg = Registry()
    reg.register(
        OperationType(name="odd.pay", model=model, effect_fields=("amount",), provider="p")
    )
    fps = {
        reg.prepare(
            tenant_id="t",
            operation="odd.pay",
            idempotency_key="k",
            request={"amount": 1, "field": tags},
        ).new.fingerprint
        for tags in (["a", "b"], ["b", "a"], [])
    }
    assert len(fps) == 1


def _model_with(annotation: Any) -> type[BaseModel]:
    from pydantic import create_model

    return create_model("Odd", amount=(int, ...), field=(annotation, None))


# -- NaN and infinities: bad input (4xx), never a storage error ---------------------------


class Quote(BaseModel):
    amount: int
    currency: str
    fx_rate: float = 1.0  # not an effect field: floats are allowed, but only finite ones
    attributes: dict[str, Any] = Field(default_factory=dict)
    weights: list[float] = Field(default_factory=list)
    note: Any = None


NAN, INF = math.nan, math.inf


@pytest.fixture
def quote_executor(store: Store, sandbox: SandboxServer, executor: Executor) -> Executor:
    executor.registry.register(
        OperationType(
            name="quote.pay",
            model=Quote,
            effect_fields=("amount", "currency", "note"),
            provider="sandbox",
            retention=timedelta(days=1),
        )
    )
    return executor


@pytest.mark.parametrize(
    ("operation", "request_"),
    [
        ("quote.pay", {"fx_rate": NAN}),
        ("quote.pay", {"fx_rate": INF}),
        ("quote.pay", {"fx_rate": -INF}),
        ("quote.pay", {"fx_rate": "NaN"}),  # pydantic parses the string form too
        ("quote.pay", {"attributes": {"deep": {"er": [1, NAN]}}}),
        ("quote.pay", {"attributes": {"x": INF}}),  # the JSON dump would quietly say null
        ("quote.pay", {"weights": [0.5, -INF]}),
        ("quote.pay", {"note": NAN}),  # an effect field
        ("quote.pay", {"note": {"rate": INF}}),
        ("payment.create", {"amount": NAN}),
        ("payment.create", {"amount": INF}),
        ("payment.create", {"metadata": {"k": NAN}}),
        ("payout.create", {"amount": -INF, "destination": "ba_1"}),
    ],
)
def test_nan_and_inf_anywhere_are_a_typed_4xx_and_nothing_is_written(
    quote_executor: Executor,
    store: Store,
    sandbox: SandboxServer,
    operation: str,
    request_: dict[str, Any],
) -> None:
    request = {"amount": 100, "currency": "EUR", **request_}
    with pytest.raises(InvalidRequest) as info:
        quote_executor.execute(
            tenant_id="t1", operation=operation, idempotency_key="nan-1", request=request
        )
    assert 400 <= info.value.http_status < 500
    if operation == "quote.pay":
        assert isinstance(info.value, UnencodableRequest)
    with store.engine.connect() as conn:
        for table in (operations, events):
            assert conn.execute(sa.select(sa.func.count()).select_from(table)).scalar() == 0
    assert sandbox.ledger() == []


def test_finite_floats_outside_the_effect_still_work(
    quote_executor: Executor, sandbox: SandboxServer
) -> None:
    outcome = quote_executor.execute(
        tenant_id="t1",
        operation="quote.pay",
        idempotency_key="fine-1",
        request={"amount": 100, "currency": "EUR", "fx_rate": 1.25, "weights": [0.5]},
    )
    assert outcome.state.value in ("succeeded", "failed_final", "outcome_unknown")
    assert outcome.operation_id
