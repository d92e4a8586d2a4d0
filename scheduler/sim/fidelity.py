"""Fidelity: the same trace through the real system and the simulator, compared.

A trace is the arrivals of a workload written out (arrival time, tenant, tier, prompt
tokens, max_tokens), so that the load generator and the simulator replay exactly the
same requests. Each side turns what happened to every request into an `Outcome`;
`summarize` computes, per tier and over all requests, P50/P99 TTFT and TPOT as the
architecture defines them, and the output throughput; `compare` puts the two summaries
side by side with the relative error of each figure and its tolerance.

Nothing here imports torch: the real replay lives in benchmarks/simulate_fidelity.py.
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scheduler.sim.cost_model import RooflineParams, StepSample, StepShape
from scheduler.sim.metrics import RequestRecord, percentile
from scheduler.sim.workload import MAX_LENGTH_TOKENS, SimRequest, WorkloadSpec

ALL = "all"  # the group of every request, beside one group per tier
OK = "ok"
LATENCY_TOLERANCE = 0.15  # P50/P99 TTFT and TPOT
THROUGHPUT_TOLERANCE = 0.10


class TraceError(ValueError):
    """A trace line that cannot be read, or a request the workload cannot place."""


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace: what the load generator sends and when."""

    request_id: str
    arrival_s: float
    tenant_id: str
    tier: str
    num_prompt_tokens: int
    max_tokens: int


def trace_of(requests: Iterable[SimRequest]) -> list[TraceRequest]:
    return [
        TraceRequest(
            r.request_id,
            r.arrival_s,
            r.tenant_id,
            r.tier,
            r.num_prompt_tokens,
            r.num_output_tokens,
        )
        for r in requests
    ]


def write_trace(trace: Iterable[TraceRequest], path: Path) -> None:
    """JSON lines, one request each, in arrival order."""
    with path.open("w", encoding="utf-8") as f:
        for r in trace:
            row = {
                "request_id": r.request_id,
                "arrival_s": r.arrival_s,
                "tenant": r.tenant_id,
                "tier": r.tier,
                "prompt_tokens": r.num_prompt_tokens,
                "max_tokens": r.max_tokens,
            }
            f.write(json.dumps(row) + "\n")


def read_trace(lines: Iterable[str]) -> list[TraceRequest]:
    trace = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            arrival, lengths = row["arrival_s"], (row["prompt_tokens"], row["max_tokens"])
            request = TraceRequest(
                str(row["request_id"]),
                float(arrival),
                str(row["tenant"]),
                str(row["tier"]),
                *(int(n) for n in lengths),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TraceError(f"trace line {lineno}: {exc!r}") from exc
        # int("12") and float("Infinity") parse, and a bool is an int: a request at an
        # infinite time never arrived, and 2.7 tokens ran as 2.
        is_number = type(arrival) in (int, float) and math.isfinite(arrival)
        if not is_number or any(type(n) is not int for n in lengths):
            raise TraceError(
                f"trace line {lineno}: arrival_s must be a finite number and the lengths integers"
            )
        if request.arrival_s < 0 or request.num_prompt_tokens < 1 or request.max_tokens < 1:
            raise TraceError(f"trace line {lineno}: needs arrival_s >= 0 and lengths >= 1")
        if max(request.num_prompt_tokens, request.max_tokens) > MAX_LENGTH_TOKENS:
            # The simulator builds each prompt as a list of token ids (see LengthDist).
            raise TraceError(f"trace line {lineno}: lengths are at most {MAX_LENGTH_TOKENS:,}")
        trace.append(request)
    return sorted(trace, key=lambda r: (r.arrival_s, r.request_id))


@dataclass(frozen=True)
class RequestPath:
    """Latency of the serving path outside the engine's steps, per request.

    ingress_s: from the client's send to the engine step that can take the request
    (HTTP, authentication, admission, the queue, the dispatcher, the engine's command
    queue); egress_s: from the end of the step that made a token to the client reading
    it (hand-off to the event loop, result channel, the SSE chunk). The simulator has
    neither: its requests reach the queue at arrival and a token exists at its step's
    end. Both are measured on the idle server; under load they grow, which this leaves
    out.
    """

    ingress_s: float = 0.0
    egress_s: float = 0.0


def sim_requests(
    trace: Sequence[TraceRequest], workload: WorkloadSpec, path: RequestPath | None = None
) -> list[SimRequest]:
    """The trace as simulator arrivals: SLOs, rank and weight from the workload's tiers
    and tenants; each arrives `path.ingress_s` late (when it reaches the queue)."""
    ingress_s = path.ingress_s if path else 0.0
    weights = {t.tenant_id: t.weight for t in workload.tenants}
    out = []
    for r in trace:
        try:
            tier = workload.tier(r.tier)
        except KeyError:
            raise TraceError(f"request {r.request_id}: unknown tier {r.tier!r}") from None
        if r.tenant_id not in weights:
            raise TraceError(f"request {r.request_id}: unknown tenant {r.tenant_id!r}")
        out.append(
            SimRequest(
                request_id=r.request_id,
                arrival_s=r.arrival_s + ingress_s,
                tenant_id=r.tenant_id,
                tier=r.tier,
                rank=tier.rank,
                weight=weights[r.tenant_id],
                num_prompt_tokens=r.num_prompt_tokens,
                num_output_tokens=r.max_tokens,
                ttft_slo_ms=tier.ttft_slo_ms,
                tpot_slo_ms=tier.tpot_slo_ms,
                preemptible=tier.preemptible,
                max_queue_ms=tier.max_queue_ms,
                deadline_s=r.arrival_s + tier.completion_window_s
                if tier.completion_window_s
                else None,
            )
        )
    return out


# ---- what happened to each request -------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One request's fate, on either side. Times are seconds on the trace's clock.

    status: "ok" when it ran to the end, else the refusal or error code (for a real
    request the API error code, or "http_<status>").
    """

    request_id: str
    tier: str
    status: str
    ttft_s: float | None = None
    tpot_s: float | None = None
    num_output_tokens: int = 0
    finish_s: float | None = None


def outcome_of(record: RequestRecord, path: RequestPath | None = None) -> Outcome:
    """A simulated request's outcome (the simulator must keep its records), on the
    client's clock: TTFT from the send (before the ingress) to the first token's
    arrival (after the egress); TPOT is the same on both clocks."""
    req = record.request
    if not record.is_finished:
        return Outcome(req.request_id, req.tier, record.rejected_code or "unfinished")
    path = path or RequestPath()
    ttft = record.ttft_s
    return Outcome(
        req.request_id,
        req.tier,
        OK,
        None if ttft is None else ttft + path.ingress_s + path.egress_s,
        record.tpot_s if req.num_output_tokens > 1 else None,
        req.num_output_tokens,
        None if record.finish_s is None else record.finish_s + path.egress_s,
    )


def request_timing(
    sent_s: float, token_times_s: Sequence[float], num_output_tokens: int
) -> tuple[float | None, float | None]:
    """TTFT and TPOT of a streamed request: first token minus arrival, and
    (E2E - TTFT) / (output tokens - 1), E2E ending at the last token."""
    if not token_times_s:
        return None, None
    ttft = token_times_s[0] - sent_s
    if num_output_tokens < 2:
        return ttft, None
    return ttft, (token_times_s[-1] - token_times_s[0]) / (num_output_tokens - 1)


# ---- summaries ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupStats:
    group: str  # a tier, or ALL
    num_requests: int
    num_finished: int
    statuses: dict[str, int]  # every status but ok, with its count
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None


@dataclass(frozen=True)
class Summary:
    groups: dict[str, GroupStats]
    num_output_tokens: int
    span_s: float  # first arrival to last finish
    output_tokens_per_s: float


def _ms(values: Sequence[float], q: float) -> float | None:
    p = percentile(values, q)
    return None if p is None else p * 1000


def _group(name: str, outcomes: Sequence[Outcome]) -> GroupStats:
    done = [o for o in outcomes if o.status == OK]
    statuses: dict[str, int] = {}
    for o in outcomes:
        if o.status != OK:
            statuses[o.status] = statuses.get(o.status, 0) + 1
    ttfts = [o.ttft_s for o in done if o.ttft_s is not None]
    tpots = [o.tpot_s for o in done if o.tpot_s is not None]
    return GroupStats(
        name,
        len(outcomes),
        len(done),
        statuses,
        _ms(ttfts, 50),
        _ms(ttfts, 99),
        _ms(tpots, 50),
        _ms(tpots, 99),
    )


def summarize(outcomes: Sequence[Outcome], *, first_arrival_s: float = 0.0) -> Summary:
    """Per tier and over all: P50/P99 TTFT and TPOT of the requests that ran to the end;
    throughput as output tokens over the span from the first arrival to the last finish
    (so a system that drains its backlog more slowly shows a lower figure)."""
    by_tier: dict[str, list[Outcome]] = {}
    for o in outcomes:
        by_tier.setdefault(o.tier, []).append(o)
    groups = {ALL: _group(ALL, outcomes)}
    for tier in sorted(by_tier):
        groups[tier] = _group(tier, by_tier[tier])
    done = [o for o in outcomes if o.status == OK and o.finish_s is not None]
    tokens = sum(o.num_output_tokens for o in done)
    span = max((o.finish_s for o in done), default=first_arrival_s) - first_arrival_s  # type: ignore[type-var]
    return Summary(groups, tokens, span, tokens / span if span > 0 else 0.0)


# ---- the comparison ----------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One figure on both sides; rel_error is (sim - real) / real."""

    group: str
    metric: str
    real: float | None
    sim: float | None
    tolerance: float

    @property
    def rel_error(self) -> float | None:
        if self.real is None or self.sim is None or self.real == 0:
            return None
        return (self.sim - self.real) / self.real

    @property
    def passed(self) -> bool:
        err = self.rel_error
        return err is not None and abs(err) <= self.tolerance


LATENCY_METRICS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def compare(
    real: Summary,
    sim: Summary,
    *,
    latency_tolerance: float = LATENCY_TOLERANCE,
    throughput_tolerance: float = THROUGHPUT_TOLERANCE,
) -> list[Check]:
    """Every latency figure of every group either side has, then the throughput."""
    checks = []
    for group in sorted(set(real.groups) | set(sim.groups), key=lambda g: (g != ALL, g)):
        r, s = real.groups.get(group), sim.groups.get(group)
        for metric in LATENCY_METRICS:
            rv = getattr(r, metric) if r else None
            sv = getattr(s, metric) if s else None
            if rv is None and sv is None:
                continue
            checks.append(Check(group, metric, rv, sv, latency_tolerance))
    checks.append(
        Check(
            ALL,
            "output_tokens_per_s",
            real.output_tokens_per_s,
            sim.output_tokens_per_s,
            throughput_tolerance,
        )
    )
    return checks


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_table(checks: Sequence[Check]) -> str:
    """A Markdown table: real and simulated side by side, error, tolerance, pass/fail."""
    lines = [
        "| group | metric | real | sim | error | tolerance | result |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for c in checks:
        err = c.rel_error
        lines.append(
            f"| {c.group} | {c.metric} | {_num(c.real)} | {_num(c.sim)} | "
            f"{'-' if err is None else f'{err:+.1%}'} | {c.tolerance:.0%} | "
            f"{'pass' if c.passed else 'FAIL'} |"
        )
    return "\n".join(lines)


def format_counts(real: Summary, sim: Summary) -> str:
    """Requests per group on both sides, with what did not run to the end."""
    lines = ["| group | requests | finished real | finished sim | not finished real | sim |"]
    lines.append("|---|---:|---:|---:|---|---|")
    for group in sorted(real.groups, key=lambda g: (g != ALL, g)):
        r = real.groups[group]
        s = sim.groups.get(group)
        lines.append(
            f"| {group} | {r.num_requests} | {r.num_finished} | "
            f"{s.num_finished if s else 0} | {_statuses(r.statuses)} | "
            f"{_statuses(s.statuses) if s else '-'} |"
        )
    return "\n".join(lines)


def _statuses(statuses: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(statuses.items())) or "-"


# ---- the real engine's steps in service ------------------------------------------------


@dataclass(frozen=True)
class LoggedStep:
    """One step of a serving engine: when it ran (perf_counter seconds), its shape, how
    many of its chunks were decodes, whether work was left when it ended, and which
    requests it ran for the first time and which it gave their first token."""

    start_s: float
    end_s: float
    shape: StepShape
    num_decodes: int
    is_busy_after: bool
    started_ids: tuple[str, ...] = ()
    first_token_ids: tuple[str, ...] = ()

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> LoggedStep:
        start, end, tokens, kv, pairs, seqs, decodes, busy, *ids = row
        shape = StepShape(int(tokens), int(kv), pairs, int(seqs))
        started, first = (tuple(ids[0]), tuple(ids[1])) if ids else ((), ())
        return cls(float(start), float(end), shape, int(decodes), bool(busy), started, first)

    def to_row(self) -> list[Any]:
        s = self.shape
        return [
            self.start_s,
            self.end_s,
            s.num_batched_tokens,
            s.num_kv_tokens,
            s.num_attention_pairs,
            s.num_seqs,
            self.num_decodes,
            self.is_busy_after,
            list(self.started_ids),
            list(self.first_token_ids),
        ]


def request_path_in_service(
    requests: Iterable[tuple[str, float, float]], steps: Sequence[LoggedStep]
) -> RequestPath:
    """The request path as it was under load: (server request id, send, first token at
    the client) of each request, matched by id to the step that first ran it and the
    step that made its first token (same monotonic clock); the medians."""
    started = {i: s.start_s for s in steps for i in s.started_ids}
    produced = {i: s.end_s for s in steps for i in s.first_token_ids}
    ingress, egress = [], []
    for request_id, sent_s, first_s in requests:
        if request_id in started and request_id in produced:
            ingress.append(started[request_id] - sent_s)
            egress.append(first_s - produced[request_id])
    if not ingress:
        return RequestPath()
    return RequestPath(statistics.median(ingress), statistics.median(egress))


def _cycles(steps: Sequence[LoggedStep]) -> list[tuple[LoggedStep, float]]:
    return [
        (step, nxt.start_s - step.start_s)
        for step, nxt in itertools.pairwise(steps)
        if step.is_busy_after and nxt.start_s > step.start_s
    ]


def cycle_samples(steps: Sequence[LoggedStep]) -> list[StepSample]:
    """Step samples as a serving engine runs them: from one step's start to the next's,
    for steps after which work was left (so the engine went straight on). The time
    between two steps (outputs handed to the event loop, commands applied, the GIL
    shared with the HTTP side) is part of what a simulated step stands for."""
    return [StepSample(step.shape, cycle_s) for step, cycle_s in _cycles(steps)]


@dataclass(frozen=True)
class StepFit:
    """How well a cost model predicts one kind of measured step cycle."""

    kind: str
    num_steps: int
    measured_ms: float
    predicted_ms: float
    between_steps_ms: float  # mean time from a step's end to the next one's start


def step_kind(shape: StepShape, num_decodes: int) -> str:
    if num_decodes == shape.num_batched_tokens:
        return "decode"
    return "prefill" if num_decodes == 0 else "mixed"


def step_fits(steps: Sequence[LoggedStep], params: RooflineParams) -> list[StepFit]:
    """Mean measured and predicted cycle time per kind of step (decode only, prefill
    only, mixed), over the cycles `cycle_samples` keeps."""
    by_kind: dict[str, list[tuple[float, float, float]]] = {}
    for step, cycle_s in _cycles(steps):
        kind = step_kind(step.shape, step.num_decodes)
        between = cycle_s - (step.end_s - step.start_s)
        by_kind.setdefault(kind, []).append((cycle_s, params.shape_time_s(step.shape), between))
    return [
        StepFit(
            kind,
            len(rows),
            1000 * sum(r[0] for r in rows) / len(rows),
            1000 * sum(r[1] for r in rows) / len(rows),
            1000 * sum(r[2] for r in rows) / len(rows),
        )
        for kind, rows in sorted(by_kind.items())
    ]


def decode_cycles_by_batch(
    steps: Sequence[LoggedStep], params: RooflineParams, *, batches: Sequence[int] = (1, 2, 4, 8)
) -> list[tuple[int, int, float, float]]:
    """(decodes per step, steps, mean measured cycle ms, mean predicted ms) of pure
    decode steps of about each batch size (up to the next one listed): how the cost of
    a step grows with the sequences in it, in service and in the model."""
    rows: dict[int, list[tuple[float, float]]] = {b: [] for b in batches}
    for step, cycle_s in _cycles(steps):
        if step_kind(step.shape, step.num_decodes) != "decode":
            continue
        batch = max((b for b in batches if b <= step.num_decodes), default=None)
        if batch is not None:
            rows[batch].append((cycle_s, params.shape_time_s(step.shape)))
    return [
        (b, len(r), 1000 * sum(m for m, _ in r) / len(r), 1000 * sum(p for _, p in r) / len(r))
        for b, r in rows.items()
        if r
    ]
