"""An operator reconciling /admin/v1/usage with itself and with /metrics on live traffic."""

from __future__ import annotations

import csv
import io
import re
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

import httpx
import pytest

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer


@pytest.fixture(scope="module")
def live_database_url(tmp_path_factory) -> str:
    """The rows' shape does not depend on the database (test_usage_api covers both)."""
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('operator') / 'tiergate.db'}"


def _abort_one_stream(server: LiveServer, key: str) -> None:
    """A streamed request whose client goes away after its first chunk."""
    with server.client(key) as client:
        stream = client.completions.create(
            model="tiny-random", prompt="go on", max_tokens=200, stream=True
        )
        next(iter(stream))
        stream.close()


def _usage_line(server: LiveServer, tenant: str, start: str, num_requests: int) -> dict:
    """The tenant's one usage row, once the writer has flushed `num_requests` requests."""
    with server.admin() as admin:
        deadline = time.monotonic() + 10
        while True:
            reply = admin.get("/usage", params={"start": start, "tenant_id": tenant})
            assert reply.status_code == 200, reply.text
            data = reply.json()["data"]
            if (data and data[0]["requests"] >= num_requests) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    assert len(data) == 1
    return data[0]


def _metric(server: LiveServer, tenant: str, outcome: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics").text
    pattern = rf'tiergate_requests_total\{{outcome="{outcome}",tenant="{tenant}",[^}}]*\}} (\S+)'
    return sum(float(value) for value in re.findall(pattern, text))


def test_usage_rows_show_aborted_requests(live_server: LiveServer) -> None:
    """slo_attainment is slo_met / (requests - aborted): without `aborted` in the row an
    operator sees 2 met of 3 requests reported as 100%, and cannot match the row with
    /metrics' outcome="aborted" count."""
    tier = "batch"  # no latency SLO: every completed request meets it, on any machine
    tenant, key = live_server.tenant_ids[tier], live_server.keys[tier]
    start = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    with live_server.client(key) as client:
        for _ in range(2):
            client.completions.create(model="tiny-random", prompt="bill me", max_tokens=2)
    _abort_one_stream(live_server, key)

    line = _usage_line(live_server, tenant, start, 3)
    assert (line["requests"], line["aborted"], line["slo_met"]) == (3, 1, 2)
    assert line["slo_attainment"] == line["slo_met"] / (line["requests"] - line["aborted"])
    assert _metric(live_server, tenant, "aborted") == line["aborted"]
    assert _metric(live_server, tenant, "ok") == line["requests"] - line["aborted"]

    with live_server.admin() as admin:
        exported = admin.get(
            "/usage", params={"start": start, "tenant_id": tenant, "format": "csv"}
        )
    (row,) = csv.DictReader(io.StringIO(exported.text))
    assert int(row["aborted"]) == 1
    assert float(row["slo_attainment"]) == pytest.approx(
        int(row["slo_met"]) / (int(row["requests"]) - int(row["aborted"]))
    )


def test_metrics_say_which_series_repeat_on_every_gateway(live_server: LiveServer) -> None:
    """Queue depth and the workers' engine series come from the shared backend, so every
    gateway reports them: their HELP must say to take max across gateways (as the queue
    totals' did), or a fleet dashboard's sum() shows N gateways times the real backlog."""
    text = httpx.get(f"{live_server.base_url}/metrics").text
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, flags=re.MULTILINE))
    repeated = [
        "tiergate_queue_depth",
        "tiergate_queue_lease_expirations_total",
        "tiergate_engine_running",
        "tiergate_engine_kv_cache_utilization",
        "tiergate_engine_preemptions_total",
        "tiergate_engine_token_rate_per_second",
    ]
    for name in repeated:
        assert "take max, not sum, across gateways" in helps[name], name
    assert "across gateways" not in helps["tiergate_requests_total"]  # per gateway: sum
