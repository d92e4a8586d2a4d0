"""Fidelity comparison: traces, outcomes, summaries and the tolerance table."""

from __future__ import annotations

import pytest

from scheduler.sim.cost_model import StepShape, load_preset
from scheduler.sim.fidelity import (
    ALL,
    OK,
    Check,
    LoggedStep,
    Outcome,
    RequestPath,
    TraceError,
    compare,
    cycle_samples,
    decode_cycles_by_batch,
    format_table,
    outcome_of,
    read_trace,
    request_path_in_service,
    request_timing,
    sim_requests,
    step_fits,
    summarize,
    trace_of,
    write_trace,
)
from scheduler.sim.fleet import FleetSpec, SimOptions, simulate
from scheduler.sim.workload import generate, three_tier_mix


def test_trace_round_trip_and_back_to_simulator_requests(tmp_path) -> None:
    spec = three_tier_mix(5.0, 10.0, seed=4)
    requests = generate(spec)
    path = tmp_path / "trace.jsonl"
    write_trace(trace_of(requests), path)
    trace = read_trace(path.read_text().splitlines())
    assert trace == trace_of(requests)
    # SLOs, rank, weight and deadline come back from the workload's tiers and tenants.
    assert sim_requests(trace, spec) == requests


def test_read_trace_sorts_and_rejects_bad_lines() -> None:
    lines = [
        '{"request_id": "b", "arrival_s": 2, "tenant": "t", "tier": "batch", '
        '"prompt_tokens": 5, "max_tokens": 3}',
        "",
        '{"request_id": "a", "arrival_s": 1, "tenant": "t", "tier": "batch", '
        '"prompt_tokens": 5, "max_tokens": 3}',
    ]
    assert [r.request_id for r in read_trace(lines)] == ["a", "b"]
    with pytest.raises(TraceError, match="line 1"):
        read_trace(['{"request_id": "a"}'])
    with pytest.raises(TraceError, match="lengths >= 1"):
        read_trace([lines[0].replace('"max_tokens": 3', '"max_tokens": 0')])
    # A 10^9-token prompt hung the simulator building it.
    with pytest.raises(TraceError, match="at most 1,048,576"):
        read_trace([lines[0].replace('"prompt_tokens": 5', '"prompt_tokens": 1000000000')])
    for field, bad in (
        ("arrival_s", "NaN"),
        ("arrival_s", "Infinity"),
        ("arrival_s", '"2"'),
        ("arrival_s", "true"),
        ("prompt_tokens", "true"),
        ("prompt_tokens", "2.7"),
        ("max_tokens", '"3"'),
    ):
        good = {"arrival_s": "2", "prompt_tokens": "5", "max_tokens": "3"}[field]
        with pytest.raises(TraceError, match="finite number and the lengths integers"):
            read_trace([lines[0].replace(f'"{field}": {good}', f'"{field}": {bad}')])
    spec = three_tier_mix(1.0, 1.0)
    unknown = read_trace([lines[0].replace('"batch"', '"gold"')])
    with pytest.raises(TraceError, match="unknown tier"):
        sim_requests(unknown, spec)


def test_request_timing_follows_the_definitions() -> None:
    # Sent at 1.0, tokens at 1.5 (first), then three more up to 2.1.
    ttft, tpot = request_timing(1.0, [1.5, 1.7, 1.9, 2.1], 4)
    assert ttft == pytest.approx(0.5)
    assert tpot == pytest.approx(0.2)
    # Two tokens in one chunk: the count comes from usage, not from the chunks.
    ttft, tpot = request_timing(1.0, [1.5, 2.1], 4)
    assert tpot == pytest.approx(0.2)
    assert request_timing(1.0, [1.2], 1) == (pytest.approx(0.2), None)
    assert request_timing(1.0, [], 3) == (None, None)


def _outcome(i: int, tier: str, ttft_ms: float, tpot_ms: float, tokens: int = 10) -> Outcome:
    return Outcome(f"r{i}", tier, OK, ttft_ms / 1000, tpot_ms / 1000, tokens, 1.0 + i)


def test_summarize_per_tier_and_overall() -> None:
    outcomes = [_outcome(i, "interactive", 100 + i, 10) for i in range(100)]
    outcomes += [_outcome(100, "batch", 1000, 20), Outcome("x", "batch", "slo_unattainable")]
    summary = summarize(outcomes)
    inter = summary.groups["interactive"]
    assert inter.num_requests == inter.num_finished == 100
    assert inter.ttft_p50_ms == pytest.approx(149.5)
    assert inter.ttft_p99_ms == pytest.approx(198.01)
    batch = summary.groups["batch"]
    assert (batch.num_requests, batch.num_finished) == (2, 1)
    assert batch.statuses == {"slo_unattainable": 1}
    assert summary.groups[ALL].num_requests == 102
    # 101 finished requests of 10 tokens, the last finishing at 101 s.
    assert summary.span_s == pytest.approx(101.0)
    assert summary.output_tokens_per_s == pytest.approx(1010 / 101)


def test_compare_applies_the_tolerances() -> None:
    real = summarize([_outcome(i, "priority", 100, 10) for i in range(10)])
    close = summarize([_outcome(i, "priority", 114, 8.6) for i in range(10)])
    far = summarize([_outcome(i, "priority", 116, 10) for i in range(10)])
    checks = {(c.group, c.metric): c for c in compare(real, close)}
    assert checks[("priority", "ttft_p50_ms")].rel_error == pytest.approx(0.14)
    assert checks[("priority", "ttft_p50_ms")].passed
    assert checks[("priority", "tpot_p50_ms")].passed  # 14% under is within 15%
    assert checks[("priority", "tpot_p50_ms")].rel_error == pytest.approx(-0.14)
    assert not {(c.group, c.metric): c for c in compare(real, far)}[
        ("priority", "ttft_p50_ms")
    ].passed
    throughput = [c for c in compare(real, close) if c.metric == "output_tokens_per_s"]
    assert len(throughput) == 1
    assert throughput[0].tolerance == 0.10


def test_a_figure_missing_on_one_side_fails() -> None:
    assert not Check(ALL, "ttft_p50_ms", 10.0, None, 0.15).passed
    assert not Check(ALL, "ttft_p50_ms", 0.0, 0.0, 0.15).passed
    assert Check(ALL, "ttft_p50_ms", 10.0, 11.5, 0.15).passed


def test_format_table_shows_both_sides_and_the_verdict() -> None:
    table = format_table([Check("batch", "tpot_p99_ms", 20.0, 25.0, 0.15)])
    row = table.splitlines()[-1]
    assert row == "| batch | tpot_p99_ms | 20.0 | 25.0 | +25.0% | 15% | FAIL |"


def test_simulated_records_become_outcomes() -> None:
    spec = three_tier_mix(2.0, 5.0, seed=1)
    trace = trace_of(generate(spec))
    result = simulate(
        spec,
        "tiered",
        FleetSpec(load_preset("h200-llama-3.1-8b")),
        SimOptions(drain_s=60.0, keep_records=True),
        requests=sim_requests(trace, spec),
    )
    outcomes = [outcome_of(r) for r in result.collector.records]
    assert sorted(o.request_id for o in outcomes) == sorted(r.request_id for r in trace)
    lengths = {r.request_id: r.max_tokens for r in trace}
    for o in outcomes:
        assert o.status == OK
        assert o.num_output_tokens == lengths[o.request_id]
        assert o.ttft_s is not None
        assert o.ttft_s > 0
    summary = summarize(outcomes)
    assert summary.groups[ALL].num_finished == len(trace)


def _step(start: float, end: float, tokens: int, decodes: int, busy: bool) -> LoggedStep:
    shape = StepShape(tokens, tokens * 10, tokens * 10.0, decodes + (tokens > decodes))
    return LoggedStep(start, end, shape, decodes, busy)


def test_cycle_samples_run_from_step_start_to_step_start_while_busy() -> None:
    steps = [
        _step(0.000, 0.008, 4, 4, True),
        _step(0.009, 0.017, 4, 4, True),
        _step(0.018, 0.050, 64, 3, False),  # then the engine idles
        _step(0.500, 0.508, 1, 1, True),
    ]
    samples = cycle_samples(steps)
    assert [s.step_s for s in samples] == pytest.approx([0.009, 0.009])
    assert LoggedStep.from_row(steps[2].to_row()) == steps[2]
    fits = {f.kind: f for f in step_fits(steps, load_preset("cpu-tiny"))}
    assert set(fits) == {"decode"}
    assert fits["decode"].num_steps == 2
    assert fits["decode"].measured_ms == pytest.approx(9.0)
    assert fits["decode"].between_steps_ms == pytest.approx(1.0)


def test_decode_cycles_by_batch_groups_pure_decode_steps() -> None:
    steps = [
        _step(0.000, 0.004, 1, 1, True),
        _step(0.005, 0.010, 2, 2, True),
        _step(0.012, 0.020, 3, 3, True),
        _step(0.023, 0.060, 64, 2, True),  # mixed: not counted
        _step(0.061, 0.070, 9, 9, True),
        _step(0.071, 0.080, 9, 9, False),  # nothing follows it
    ]
    rows = decode_cycles_by_batch(steps, load_preset("cpu-tiny"), batches=(1, 2, 8))
    assert [(b, n) for b, n, _, _ in rows] == [(1, 1), (2, 2), (8, 1)]
    assert rows[1][2] == pytest.approx((7.0 + 11.0) / 2)


def test_the_request_path_moves_arrivals_and_first_tokens_to_the_clients_clock() -> None:
    spec = three_tier_mix(2.0, 5.0, seed=1)
    trace = trace_of(generate(spec))
    path = RequestPath(ingress_s=0.002, egress_s=0.003)
    shifted = sim_requests(trace, spec, path)
    assert [r.arrival_s for r in shifted] == pytest.approx([r.arrival_s + 0.002 for r in trace])
    options = SimOptions(drain_s=60.0, keep_records=True)
    params = FleetSpec(load_preset("h200-llama-3.1-8b"))
    plain = simulate(spec, "fcfs", params, options, requests=sim_requests(trace, spec))
    moved = simulate(spec, "fcfs", params, options, requests=shifted)
    before = {o.request_id: o for o in map(outcome_of, plain.collector.records)}
    after = {r.request.request_id: outcome_of(r, path) for r in moved.collector.records}
    for request_id, o in before.items():
        # The engine sees the same requests 2 ms later: TTFT grows by the whole path.
        assert after[request_id].ttft_s == pytest.approx(o.ttft_s + 0.005, abs=1e-6)
        assert after[request_id].finish_s == pytest.approx(o.finish_s + 0.005, abs=1e-6)
        assert after[request_id].tpot_s == pytest.approx(o.tpot_s, abs=1e-9)


@pytest.mark.slow
def test_a_short_trace_through_the_real_server_and_the_simulator(tmp_path) -> None:
    """The benchmark's harness end to end: server process, tenants, open-loop replay."""
    import asyncio
    import importlib.util
    import json
    import secrets
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "simulate_fidelity.py"
    spec_ = importlib.util.spec_from_file_location("simulate_fidelity", path)
    bench = importlib.util.module_from_spec(spec_)
    sys.modules.setdefault("simulate_fidelity", bench)  # its dataclasses look it up
    spec_.loader.exec_module(bench)

    token = secrets.token_urlsafe(16)
    port = bench._free_port()
    url = f"http://127.0.0.1:{port}"
    step_log = tmp_path / "steps.jsonl"
    server = bench._spawn(
        *("--serve", "--port", str(port), "--data-dir", str(tmp_path), f"--admin-token={token}"),
        *("--threads", "1", "--step-log", str(step_log)),
    )
    try:
        bench._wait_up(url, server)
        workload = bench.workload_spec(bench.server_tiers(url, token), 4.0, 2.0, seed=5)
        trace = trace_of(generate(workload))
        keys = bench._tenant_keys(url, token, workload.tenants)
        sent = asyncio.run(bench.replay(port, trace, keys, bench._text_ids(), 5))
    finally:
        server.terminate()
        server.wait(timeout=60)
    outcomes = {s.outcome.request_id: s.outcome for s in sent}
    assert sorted(outcomes) == sorted(r.request_id for r in trace)
    for r in trace:
        o = outcomes[r.request_id]
        assert o.status == OK, o
        assert o.num_output_tokens == r.max_tokens  # the harness keeps the trace's lengths
        assert o.ttft_s > 0
    steps = [LoggedStep.from_row(json.loads(line)) for line in step_log.read_text().splitlines()]
    assert sum(s.shape.num_batched_tokens for s in steps) >= sum(r.num_prompt_tokens for r in trace)


def test_request_path_in_service_matches_requests_to_their_steps_by_id() -> None:
    steps = [
        LoggedStep(1.000, 1.020, StepShape(64, 64, 2080.0, 1), 0, True, ("a",), ("a",)),
        LoggedStep(1.021, 1.030, StepShape(33, 97, 600.0, 2), 1, True, ("b",), ()),
        LoggedStep(1.031, 1.040, StepShape(2, 99, 99.0, 2), 2, True, (), ("b",)),
    ]
    requests = [("a", 0.990, 1.024), ("b", 1.015, 1.046), ("lost", 1.0, 1.1)]
    path = request_path_in_service(requests, steps)
    # a: 10 ms in, 4 ms out; b: 6 ms in, 6 ms out; medians of the two.
    assert path.ingress_s == pytest.approx(0.008)
    assert path.egress_s == pytest.approx(0.005)
    assert LoggedStep.from_row(steps[1].to_row()) == steps[1]
    assert request_path_in_service([], steps) == RequestPath()
