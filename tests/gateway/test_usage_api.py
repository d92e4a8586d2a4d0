"""/admin/v1/usage: the aggregation on both databases, and the HTTP API (JSON, CSV, errors)."""

from __future__ import annotations

import csv
import io
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

import httpx
import pytest
from sqlalchemy import update

from gateway.admin.usage_report import UsageQuery, usage_report, usage_report_from_records
from gateway.db.models import Tier
from gateway.usage import UsageRecord, write_usage

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer

T0 = datetime(2025, 3, 1, 10, 0, tzinfo=UTC)


def row(tenant: str, tier: str, at: datetime, **over: Any) -> UsageRecord:
    values: dict[str, Any] = {
        "request_id": f"req_{tenant}_{at.timestamp()}_{over.get('outcome', 'ok')}",
        "tenant_id": tenant,
        "tier": tier,
        "model": "tiny-random",
        "prompt_tokens": 100,
        "completion_tokens": 11,
        "queue_wait_ms": 1.0,
        "ttft_ms": 100.0,
        "e2e_ms": 100.0 + 10 * 20.0,  # TPOT 20 ms
        "outcome": "ok",
        "created_at": at,
    }
    values.update(over)
    return UsageRecord(**values)


async def test_report_counts_tokens_slo_refusals_and_cost(db_sessionmaker) -> None:
    async with db_sessionmaker() as session, session.begin():
        await session.execute(
            update(Tier)
            .where(Tier.name == "interactive")
            .values(
                ttft_slo_ms=500.0,
                tpot_slo_ms=50.0,
                price_input_per_mtok=2.0,
                price_output_per_mtok=10.0,
            )
        )
        rows = [
            row("ten_a", "interactive", T0 + timedelta(minutes=1)),  # met
            row("ten_a", "interactive", T0 + timedelta(minutes=2), ttft_ms=900.0),  # TTFT miss
            # TPOT (2100 - 100) / 10 = 200 ms: a miss.
            row("ten_a", "interactive", T0 + timedelta(minutes=3), e2e_ms=2100.0),
            row(
                "ten_a",
                "interactive",
                T0 + timedelta(minutes=4),
                outcome="rejected:rate_limit_exceeded",
                completion_tokens=0,
                ttft_ms=None,
                e2e_ms=1.0,
            ),
            row("ten_a", "interactive", T0 + timedelta(minutes=5), outcome="aborted"),
            # The client's own mistake (a bad parameter) is no part of the service.
            row(
                "ten_a",
                "interactive",
                T0 + timedelta(minutes=6),
                outcome="invalid:invalid_request_error",
                completion_tokens=0,
                queue_wait_ms=None,
                ttft_ms=None,
                e2e_ms=1.0,
            ),
            row("ten_a", "interactive", T0 + timedelta(hours=1, minutes=5)),  # next hour
            row("ten_b", "batch", T0 + timedelta(minutes=7), ttft_ms=60_000.0),  # no SLO: met
            row("ten_a", "interactive", T0 - timedelta(minutes=1)),  # before the range
            row("ten_a", "interactive", T0 + timedelta(days=1)),  # after it
        ]
        # As the UsageWriter writes a batch: records and hourly rollup together.
        await write_usage(session, rows)
        # A batch of mistakes alone adds nothing to the rollup (and is no error).
        mistake = row("ten_c", "interactive", T0 + timedelta(minutes=8), outcome="invalid:x")
        await write_usage(session, [mistake])

    hourly = await usage_report(db_sessionmaker, UsageQuery(T0, T0 + timedelta(hours=3), "hour"))
    keyed = {(line.period_start, line.tenant_id, line.tier): line for line in hourly}
    assert list(keyed) == [
        (T0, "ten_a", "interactive"),
        (T0, "ten_b", "batch"),
        (T0 + timedelta(hours=1), "ten_a", "interactive"),
    ]
    first = keyed[(T0, "ten_a", "interactive")]
    assert first.requests == 5
    assert first.refusals == 1
    assert first.input_tokens == 4 * 100  # the refused request's prompt was not served
    assert first.output_tokens == 4 * 11
    assert first.slo_met == 1
    assert first.slo_attainment == pytest.approx(1 / 4)  # the aborted one is not counted
    assert first.cost == pytest.approx((400 * 2.0 + 44 * 10.0) / 1e6)
    batch = keyed[(T0, "ten_b", "batch")]
    assert batch.slo_met == 1
    assert batch.as_dict()["slo_attainment"] == 1.0

    assert (
        await usage_report_from_records(
            db_sessionmaker, UsageQuery(T0, T0 + timedelta(hours=3), "hour")
        )
        == hourly
    )
    # Minutes off the hour: the edges come from the records, the middle from the rollup.
    edges = await usage_report(
        db_sessionmaker, UsageQuery(T0 + timedelta(minutes=2), T0 + timedelta(hours=2, minutes=6))
    )
    assert [(line.period_start, line.tenant_id, line.requests) for line in edges] == [
        (T0, "ten_a", 4),
        (T0, "ten_b", 1),
        (T0 + timedelta(hours=1), "ten_a", 1),
    ]

    daily = await usage_report(
        db_sessionmaker,
        UsageQuery(T0 - timedelta(hours=10), T0 + timedelta(hours=3), "day", tenant_id="ten_a"),
    )
    assert [(line.period_start, line.requests) for line in daily] == [(T0.replace(hour=0), 7)]
    by_tier = await usage_report(
        db_sessionmaker, UsageQuery(T0, T0 + timedelta(hours=3), "day", tier="batch")
    )
    assert [(line.tenant_id, line.requests) for line in by_tier] == [("ten_b", 1)]


@pytest.fixture(scope="module")
def live_database_url(tmp_path_factory) -> str:
    """The HTTP layer does not depend on the database (the aggregation test covers both)."""
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('usage') / 'tiergate.db'}"


def test_usage_api_reports_live_traffic_as_json_and_csv(live_server: LiveServer) -> None:
    tenant = live_server.tenant_ids["priority"]
    with live_server.client(live_server.keys["priority"]) as client:
        for _ in range(3):
            client.completions.create(model="tiny-random", prompt="bill me", max_tokens=3)
    start = (datetime.now(UTC) - timedelta(hours=1)).isoformat()
    with live_server.admin() as admin:
        data: list[dict] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the usage writer flushes every 50 ms here
            reply = admin.get("/usage", params={"start": start, "tenant_id": tenant})
            assert reply.status_code == 200, reply.text
            data = reply.json()["data"]
            if data and data[0]["requests"] >= 3:
                break
            time.sleep(0.1)
        assert len(data) == 1
        line = data[0]
        assert line["tier"] == "priority"
        assert line["requests"] == 3
        assert line["input_tokens"] > 0
        assert line["output_tokens"] > 0
        assert line["cost"] > 0  # the seeded priority tier has prices
        assert 0.0 <= line["slo_attainment"] <= 1.0

        exported = admin.get(
            "/usage", params={"start": start, "tenant_id": tenant, "format": "csv"}
        )
        assert exported.status_code == 200
        assert exported.headers["content-type"].startswith("text/csv")
        assert "attachment" in exported.headers["content-disposition"]
        records = list(csv.DictReader(io.StringIO(exported.text)))
        assert len(records) == 1
        assert records[0]["tenant_id"] == tenant
        assert int(records[0]["requests"]) == 3
        assert float(records[0]["cost"]) == pytest.approx(line["cost"])
        assert "e" not in records[0]["cost"]  # plain decimals, however small


def test_csv_costs_are_plain_decimals() -> None:
    from gateway.admin.usage_routes import decimal_text

    assert [decimal_text(x) for x in (1.2e-05, 1.525e-05, 0.0, 3.0, 12.5, 1e-10)] == [
        "0.000012",
        "0.00001525",
        "0",
        "3",
        "12.5",
        "0",
    ]


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"start": "yesterday"}, "start"),
        ({"start": "2025-01-02T00:00:00Z", "end": "2025-01-01T00:00:00Z"}, "start"),
        ({"start": "2020-01-01T00:00:00Z", "end": "2025-01-01T00:00:00Z"}, "start"),
        ({"group_by": "week"}, "group_by"),
        ({"format": "xml"}, "format"),
        ({"tenant_id": "x" * 41}, "tenant_id"),
        # NUL reached PostgreSQL as a driver error: a 500.
        ({"tenant_id": "ten_\x00abc"}, "tenant_id"),
        ({"tier": "batch\x00"}, "tier"),
        ({"tier": "Batch Tier"}, "tier"),
    ],
)
def test_bad_queries_answer_400(live_server: LiveServer, params: dict, param: str) -> None:
    with live_server.admin() as admin:
        reply = admin.get("/usage", params=params)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == param


def test_usage_needs_the_admin_token(live_server: LiveServer) -> None:
    reply = httpx.get(
        f"{live_server.base_url}/admin/v1/usage",
        headers={"authorization": f"Bearer {live_server.keys['priority']}"},
    )
    assert reply.status_code == 401
