"""/metrics on a live server: request outcomes, refusals, latency histograms, SLO
attainment, queue depth and the engine's gauges, in the Prometheus text format; plus the
bounded tenant label and the JSON log lines."""

from __future__ import annotations

import io
import json
import logging
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.app import build_app
from gateway.observability import JsonFormatter, Telemetry, TelemetryConfig
from gateway.observability.logs import request_id_var, trace_id_var
from gateway.observability.tenant_labels import OTHER, TenantLabels
from gateway.settings import Settings
from tests.gateway.conftest import ServerThread, build_test_engine

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer

MODEL = "tiny-random"
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def live_database_url(tmp_path_factory) -> str:
    """Metrics do not depend on the database: one SQLite server is enough here."""
    return f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('metrics') / 'tiergate.db'}"


def scrape(server: LiveServer) -> Samples:
    response = httpx.get(f"{server.base_url}/metrics", timeout=30)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def names(samples: Samples) -> set[str]:
    return {name for name, _ in samples}


def test_requests_refusals_and_latencies_are_counted(live_server: LiveServer) -> None:
    tenant = live_server.tenant_ids["interactive"]
    before = scrape(live_server)
    client = live_server.client()
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="Count me", max_tokens=4, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream"}],
        max_tokens=4,
        temperature=0,
        stream=True,
    )
    assert list(stream)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=live_server.max_model_len)
    # A tenant allowed one request a minute is refused its second: a refusal.
    limited = live_server.client(live_server.new_key("interactive", rpm=1))
    limited.completions.create(model=MODEL, prompt="x", max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        limited.completions.create(model=MODEL, prompt="x", max_tokens=2)

    after = scrape(live_server)

    def grown(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grown("tiergate_requests_total", tier="interactive", tenant=tenant, outcome="ok") == 4
    # The client's own mistakes are counted apart: neither refusals nor SLO misses.
    invalid = dict(tier="interactive", tenant=tenant, outcome="invalid")
    assert grown("tiergate_requests_total", **invalid) == 2
    assert (
        grown("tiergate_requests_total", tier="interactive", tenant=tenant, outcome="rejected") == 0
    )
    for code in ("model_not_found", "context_length_exceeded"):
        assert grown("tiergate_refusals_total", tier="interactive", code=code) == 0
    assert grown("tiergate_refusals_total", tier="interactive", code="rate_limit_exceeded") == 1
    slo_counted = sum(
        grown("tiergate_slo_requests_total", tier="interactive", met=met)
        for met in ("true", "false")
    )
    assert slo_counted == 4 + 2  # the ok ones, the limited tenant's served and refused
    for histogram in ("ttft", "e2e", "queue_wait", "tpot"):
        name = f"tiergate_{histogram}_milliseconds_count"
        assert grown(name, tier="interactive") >= 3, (
            histogram
        )  # tpot needs >= 2 output tokens; 4 were asked
    # End to end: the 5 requests served; not the 2 bad ones nor the refused one, whose
    # sub-millisecond answers would pull the tier's percentiles down.
    assert grown("tiergate_e2e_milliseconds_count", tier="interactive") == 5
    inf = value(after, "tiergate_ttft_milliseconds_bucket", tier="interactive", le="+Inf")
    assert inf == value(after, "tiergate_ttft_milliseconds_count", tier="interactive")
    # Refusals count as misses; attainment is a share.
    assert grown("tiergate_slo_requests_total", tier="interactive", met="false") >= 1
    attainment = value(after, "tiergate_slo_attainment", tier="interactive")
    assert 0.0 < attainment < 1.0
    output = dict(tier="interactive", kind="output")
    assert value(after, "tiergate_tokens_total", **output) > value(
        before, "tiergate_tokens_total", **output
    )


def test_engine_and_queue_gauges_are_read_when_scraped(live_server: LiveServer) -> None:
    live_server.client().completions.create(model=MODEL, prompt="warm", max_tokens=2)
    samples = scrape(live_server)
    for tier in ("priority", "interactive", "batch"):
        assert ("tiergate_queue_depth", frozenset({("tier", tier)})) in samples
    stats = live_server.engine.stats()
    # Under the worker id the queue lists (a second `serve` on the same Redis is another
    # worker, not the same "local" series).
    with live_server.admin() as admin:
        [listed] = admin.get("/queues").json()["workers"]["data"]
    worker = frozenset({("worker", listed["id"])})
    assert samples[("tiergate_engine_step_token_budget", worker)] == stats.step_token_budget
    assert 0.0 <= samples[("tiergate_engine_kv_cache_utilization", worker)] <= 1.0
    for name in (
        "tiergate_engine_running",
        "tiergate_engine_waiting",
        "tiergate_engine_preemptions_total",
        "tiergate_engine_recomputed_tokens_total",
    ):
        assert (name, worker) in samples, name
    rates = {labels for name, labels in samples if name == "tiergate_engine_token_rate_per_second"}
    assert frozenset({("worker", listed["id"]), ("phase", "decode")}) in rates


def test_tenant_labels_stay_bounded() -> None:
    labels = TenantLabels(top_n=3, refresh_s=0.0)
    seen = set()
    for i in range(2000):
        seen.add(labels.observe(f"noise-{i}"))  # a one-request tenant each time
        for heavy in ("a", "b", "c"):
            seen.add(labels.observe(heavy))
    assert {"a", "b", "c"} <= seen
    assert len(seen) <= labels.max_labels + 1  # + "other"
    assert labels.label("a") == "a"
    assert labels.label("noise-5") == OTHER


def test_tenant_label_cardinality_on_a_live_server(live_server: LiveServer, tmp_path) -> None:
    """top_n=0 folds every tenant into "other": no tenant id reaches the exposition."""
    settings = Settings(
        data_dir=tmp_path,
        database_url=live_server.database_url,
        admin_token=live_server.admin_token,
        device="cpu",
    )
    thread = ServerThread(
        build_app(
            settings, engine=build_test_engine(), telemetry_config=TelemetryConfig(top_tenants=0)
        )
    )
    thread.start()
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{thread.port}/v1",
            api_key=live_server.keys["batch"],
            max_retries=0,
        )
        client.completions.create(model=MODEL, prompt="x", max_tokens=2)
        text = httpx.get(f"http://127.0.0.1:{thread.port}/metrics").text
    finally:
        thread.stop()
    assert 'tenant="other"' in text
    assert live_server.tenant_ids["batch"] not in text


def test_disabled_sdk_serves_an_empty_exposition() -> None:
    config = TelemetryConfig.from_env({"OTEL_SDK_DISABLED": "true"})
    assert not config.is_enabled
    telemetry = Telemetry(config)
    assert telemetry.render_metrics() == b""
    telemetry.shutdown()


def test_json_logs_carry_the_request_and_trace_ids() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("tiergate.test.jsonlogs")
    logger.addHandler(handler)
    logger.propagate = False
    id_token = request_id_var.set("req_abc")
    trace_token = trace_id_var.set("0af7651916cd43dd8448eb211c80319c")
    try:
        logger.warning("queue %s is deep", "batch", extra={"depth": 7})
    finally:
        request_id_var.reset(id_token)
        trace_id_var.reset(trace_token)
        logger.removeHandler(handler)
    line = json.loads(stream.getvalue())
    assert line["message"] == "queue batch is deep"
    assert line["level"] == "warning"
    assert line["request_id"] == "req_abc"
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    assert line["depth"] == 7


def test_a_gateway_without_an_engine_shows_the_workers_reports(
    redis_url: str, redis_prefix: str, tmp_path
) -> None:
    """`tiergate gateway` runs no engine: its metrics and dashboard show the workers'
    reports, which reach it through the shared queue."""
    import asyncio

    import redis.asyncio as aioredis

    from scheduler.keys import KeySpace
    from scheduler.redis_backend import RedisBackend

    async def report() -> None:
        client = aioredis.Redis.from_url(redis_url, decode_responses=True)
        try:
            await RedisBackend(client, keys=KeySpace(redis_prefix)).publish_capacity(
                "gpu-7",
                prefill_tokens_per_s=4000.0,
                decode_tokens_per_s=300.0,
                ttl_ms=60_000,
                num_running=5,
                num_waiting=2,
                kv_cache_usage=0.5,
                step_token_budget=512,
                num_preemptions=3,
                num_recomputed_tokens=96,
            )
        finally:
            await client.aclose()

    settings = Settings(
        data_dir=tmp_path,
        admin_token="admin-token-for-workers",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
    )
    server = ServerThread(build_app(settings, with_engine=False))
    server.start()
    try:
        asyncio.run(report())
        worker = frozenset({("worker", "gpu-7")})
        expected = {
            "tiergate_engine_running": 5,
            "tiergate_engine_waiting": 2,
            "tiergate_engine_kv_cache_utilization": 0.5,
            "tiergate_engine_step_token_budget": 512,
            "tiergate_engine_preemptions_total": 3,
            "tiergate_engine_recomputed_tokens_total": 96,
        }
        deadline = time.monotonic() + 10  # the gateway reads the reports every second
        while True:
            samples = scrape(LiveServerUrl(f"http://127.0.0.1:{server.port}"))
            got = {name: samples.get((name, worker)) for name in expected}
            if got == expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == expected
        live = httpx.get(
            f"http://127.0.0.1:{server.port}/admin/ui/api/live",
            headers={"authorization": f"Bearer {settings.admin_token}"},
        ).json()
        [shown] = live["workers"]
        assert shown["id"] == "gpu-7"
        assert shown["kv_cache_usage"] == 0.5
        assert shown["num_running"] == 5
    finally:
        server.stop()


class LiveServerUrl:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url


def test_batch_lines_are_counted_at_their_tier(live_server: LiveServer) -> None:
    """Batch API work shows in the metrics next to the live traffic it shares with."""
    import json
    import time

    tenant = live_server.tenant_ids["batch"]
    client = live_server.client(live_server.keys["batch"])
    deadline = time.monotonic() + 30  # earlier tests' usage records are written first
    while value(before := scrape(live_server), "tiergate_usage_records_pending"):
        assert time.monotonic() < deadline, "usage records stay pending"
        time.sleep(0.1)
    line = {
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "row", "max_tokens": 3, "temperature": 0},
    }
    content = "".join(json.dumps({**line, "custom_id": f"r{i}"}) + "\n" for i in range(3))
    uploaded = client.files.create(file=("rows.jsonl", content.encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while client.batches.retrieve(batch.id).status != "completed":
        assert time.monotonic() < deadline, "the batch did not complete"
        time.sleep(0.1)
    after = scrape(live_server)
    ok = dict(tier="batch", tenant=tenant, outcome="ok")
    assert (
        value(after, "tiergate_requests_total", **ok)
        - value(before, "tiergate_requests_total", **ok)
        == 3
    )
    # Their usage records, written with their results, count as written.
    written = "tiergate_usage_records_written_total"
    assert value(after, written) - value(before, written) == 3


def test_dashboard_tenants_count_what_the_usage_report_counts() -> None:
    # A refused prompt's tokens were counted as the tenant's, and an aborted request
    # (billed, in the usage report) was left out of the tenant's figures altogether.
    from gateway.usage import UsageRecord

    telemetry = Telemetry(TelemetryConfig.from_env({"OTEL_SDK_DISABLED": "true"}))

    def finished(outcome: str, prompt: int, completion: int) -> None:
        telemetry.request_finished(
            UsageRecord(
                request_id=f"req_{outcome}",
                tenant_id="ten_a",
                tier="interactive",
                model="tiny-random",
                prompt_tokens=prompt,
                completion_tokens=completion,
                queue_wait_ms=1.0,
                ttft_ms=5.0 if completion else None,
                e2e_ms=20.0,
                outcome=outcome,
                created_at=datetime.now(UTC),
            )
        )

    finished("ok", 600, 4)
    finished("rejected:rate_limit_exceeded", 600, 0)
    finished("aborted", 600, 2)
    (tenant,) = telemetry.recent.top_tenants(600, 5)
    assert (tenant["requests"], tenant["tokens"]) == (3, 604 + 602)
    # Attainment still leaves the aborted request out: it did not wait for an answer.
    assert sum(b["requests"].get("interactive", 0) for b in telemetry.recent.series(600)) == 2
    telemetry.shutdown()


def test_metrics_judge_a_request_by_the_slo_it_ran_under() -> None:
    # As the usage report does: a tier's SLO changed between the request and its count
    # does not change the verdict.
    from types import SimpleNamespace

    from gateway.observability.slo import SloTargets
    from gateway.usage import UsageRecord

    telemetry = Telemetry(TelemetryConfig.from_env({"OTEL_SDK_DISABLED": "true"}))
    tier = SimpleNamespace(name="interactive", rank=1, ttft_slo_ms=2000.0, tpot_slo_ms=None)
    telemetry.set_tiers([tier])
    for i, (ttft_ms, slo) in enumerate(
        [
            (20.0, SloTargets(ttft_slo_ms=10.0)),
            (20.0, None),
            (5000.0, SloTargets(None, None)),
            (30.0, SloTargets(ttft_slo_ms=10.0)),
        ]
    ):
        telemetry.request_finished(
            UsageRecord(
                f"req_{i}",
                "ten_a",
                "interactive",
                MODEL,
                3,
                4,
                1.0,
                ttft_ms,
                9000.0,
                "ok",
                datetime.now(UTC),
                slo=slo,
            )
        )
    (bucket,) = [b for b in telemetry.recent.series(600) if b["requests"]]
    assert (bucket["requests"]["interactive"], bucket["met"]["interactive"]) == (4, 2)
    telemetry.shutdown()


def test_usage_writer_counts_are_on_metrics(live_server: LiveServer) -> None:
    before = value(scrape(live_server), "tiergate_usage_records_written_total")
    live_server.client().completions.create(model=MODEL, prompt="count me", max_tokens=2)
    deadline = time.monotonic() + 10
    while value(samples := scrape(live_server), "tiergate_usage_records_written_total") <= before:
        assert time.monotonic() < deadline, "the record was never counted as written"
        time.sleep(0.05)
    assert ("tiergate_usage_records_pending", frozenset()) in samples
    assert value(samples, "tiergate_usage_records_dropped_total") == 0


async def test_usage_records_lost_to_a_database_away_are_counted(tmp_path) -> None:
    from gateway.db.session import create_db_engine, create_sessionmaker
    from gateway.usage import UsageRecord, UsageWriter

    engine = create_db_engine(f"sqlite+aiosqlite:///{tmp_path / 'missing' / 'usage.db'}")
    writer = UsageWriter(create_sessionmaker(engine), max_buffered=2)
    telemetry = Telemetry(TelemetryConfig.from_env({}))
    telemetry.watch_usage(writer)
    try:
        for i in range(3):
            record = UsageRecord(
                f"req_{i}", "t", "batch", MODEL, 3, 4, None, None, 9.0, "ok", datetime.now(UTC)
            )
            writer.record(record)
        assert not await writer.flush()  # no such directory: the database refuses
        samples: Samples = {}
        for family in text_string_to_metric_families(telemetry.render_metrics().decode()):
            for sample in family.samples:
                samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
        assert value(samples, "tiergate_usage_records_dropped_total") == 1
        assert value(samples, "tiergate_usage_records_pending") == 2
        assert value(samples, "tiergate_usage_records_written_total") == 0
    finally:
        telemetry.shutdown()
        await engine.dispose()
