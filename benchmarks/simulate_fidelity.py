"""Does the simulator predict the real system? One trace through both, side by side.

1. calibrate: `calibrate --measure` (scheduler.sim.calibrate) in a process of its own,
   with the engine's thread count of the real run: preset "measure";
2. workload: the three-tier mix on the real server's tiers (SLOs, ranks, shares read
   from its admin API), short CPU-sized lengths, at the rate that keeps the calibrated
   engine busy `--load` of the time; written out as a trace;
3. real: a server process (`build_app`: gateway, in-memory queue, dispatcher, engine with
   the built-in model on CPU, its steps logged); the request path measured on it idle
   (send to prefill, step end to client); a calibration replay (another draw of the
   workload) whose step cycles give preset "serving"; then the trace, open loop, from
   this process, one tenant per trace tenant, every request a streamed completion, TTFT
   and TPOT measured client-side as the architecture defines them;
4. sim: the same trace through the simulator (policy `tiered`, one engine) with each
   preset (and with "serving" fitted on the measured replay's own steps), the request
   path added;
5. the table: P50/P99 TTFT and TPOT per tier and overall, output tokens/s, with the
   relative error and pass/fail (15% for latencies, 10% for throughput), the measured
   step cycles against each preset's prediction, and the spread over `--repeats`.

The server's engine is the real one with one harness change: sampled token ids that
would end a request early (end of sequence) or stream no text on their own (special
tokens, pieces of a multi-byte character) are mapped to a plain text token after
sampling. Every request then runs to its trace length and every token arrives as text,
which is what the trace and the client's timing need; the compute of every step is
untouched. See docs/simulate.md, "Fidelity".

    python benchmarks/simulate_fidelity.py [--load 0.7] [--duration 60] [--repeats 3]
        [--same-trace] [--out fidelity-out]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# Run as a script, this file's folder leads sys.path and its sibling benchmarks (named
# like the packages they measure) would shadow the packages; the checkout goes first.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from scheduler.sim.cost_model import RooflineParams, fit_roofline, load_params  # noqa: E402
from scheduler.sim.fidelity import (  # noqa: E402
    OK,
    Check,
    LoggedStep,
    Outcome,
    RequestPath,
    StepFit,
    Summary,
    TraceRequest,
    compare,
    cycle_samples,
    decode_cycles_by_batch,
    format_counts,
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
from scheduler.sim.fleet import FleetSpec, SimOptions, simulate  # noqa: E402
from scheduler.sim.workload import (  # noqa: E402
    LengthDist,
    TenantSpec,
    TierSpec,
    WorkloadSpec,
    generate,
)

REPO_ROOT = _HERE.parent
MODEL = "tiny-random"
# CPU-sized lengths: chat-like latency tiers, longer batch jobs (tokens).
LENGTHS = {
    "priority": (
        LengthDist("lognormal", 64, 0.6, 16, 256),
        LengthDist("lognormal", 24, 0.5, 8, 64),
    ),
    "interactive": (
        LengthDist("lognormal", 128, 0.7, 16, 512),
        LengthDist("lognormal", 32, 0.6, 8, 96),
    ),
    "batch": (
        LengthDist("lognormal", 256, 0.5, 32, 768),
        LengthDist("lognormal", 48, 0.5, 16, 128),
    ),
}
TENANTS_PER_TIER = {"priority": 2, "interactive": 4, "batch": 2}
LOAD_SHARES = {"priority": 0.15, "interactive": 0.5, "batch": 0.35}


# ---------------------------------------------------------------- the harness engine
def text_token_ids(tokenizer: Any) -> list[int]:
    """Ids that stream as text on their own: not end of sequence, not special, and whole
    characters (a piece of a multi-byte character is held back until the rest comes)."""
    ids = []
    for token in range(tokenizer.vocab_size):
        if token in tokenizer.eos_token_ids:
            continue
        text = tokenizer.decode([token])  # special tokens decode to nothing
        if text.strip() and "\ufffd" not in text:
            ids.append(token)
    return ids


class TextTokenRunner:
    """Wraps the real model runner: the same forward pass and sampling, then each
    sampled id that is not a text token is replaced by one (see the module docstring)."""

    def __init__(self, runner: Any, text_ids: list[int]) -> None:
        self._runner = runner
        allowed = set(text_ids)
        self._map = {t: text_ids[t % len(text_ids)] for t in range(max(text_ids) + 1024)}
        for t in allowed:
            self._map[t] = t

    def execute(self, chunks: Any) -> list[int | None]:
        tokens = self._runner.execute(chunks)
        return [None if t is None else self._map.get(t, t) for t in tokens]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._runner, name)


def _set_threads(num_threads: int) -> None:
    import torch

    torch.set_num_threads(num_threads)


def _serve(args: argparse.Namespace) -> None:
    """The server process: the real app around the real engine (harness runner)."""
    import uvicorn

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from gateway.app import build_app
    from gateway.settings import Settings

    _set_threads(args.threads)
    llm = LLMEngine(EngineConfig(model=MODEL, device="cpu"))
    llm.runner = TextTokenRunner(llm.runner, text_token_ids(llm.tokenizer))
    if args.step_log:
        # Line-buffered: uvicorn ends the process by re-raising the signal it caught.
        _record_steps(llm, open(args.step_log, "w", buffering=1, encoding="utf-8"))  # noqa: SIM115
    settings = Settings(
        data_dir=Path(args.data_dir), admin_token=args.admin_token, device="cpu", port=args.port
    )
    app = build_app(settings, engine=AsyncEngine.from_engine(llm))
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


def _record_steps(llm: Any, log: Any) -> None:
    """Instrumentation: each step as a `LoggedStep` row (JSON list a line), to calibrate
    from the engine in service and to see where real and simulated steps differ."""
    from scheduler.sim.calibrate import plan_shape

    schedule, step = llm.scheduler.schedule, llm.step
    plans = []
    seen: set[str] = set()

    def recording_schedule():  # type: ignore[no-untyped-def]
        plan = schedule()
        plans.append(plan)
        return plan

    def timed_step():  # type: ignore[no-untyped-def]
        plans.clear()
        started = time.perf_counter()
        outputs = step()
        ended = time.perf_counter()
        if plans and not plans[-1].is_empty:
            chunks = plans[-1].chunks
            shape = plan_shape(chunks)
            decodes = sum(1 for c in chunks if c.is_decode)
            new = tuple(c.request.request_id for c in chunks if c.request.request_id not in seen)
            seen.update(new)
            first = tuple(
                c.request.request_id
                for c in chunks
                if c.produces_token and len(c.request.output_token_ids) == 1
            )
            busy = llm.has_unfinished()
            logged = LoggedStep(started, ended, shape, decodes, busy, new, first)
            log.write(json.dumps(logged.to_row()) + "\n")
        return outputs

    llm.scheduler.schedule = recording_schedule
    llm.step = timed_step


def _calibrate(args: argparse.Namespace) -> None:
    """The calibration process: `calibrate --measure` with the real run's thread count."""
    from scheduler.sim.calibrate import calibrate_engine, write_samples

    _set_threads(args.threads)
    result, samples = calibrate_engine(load_params("cpu-tiny"), MODEL, device="cpu")
    out = Path(args.calibrate_out)
    out.write_text(
        json.dumps(
            {
                "params": result.params.to_dict(),
                "mean_abs_rel_error": result.mean_abs_rel_error,
                "num_samples": result.num_samples,
            },
            indent=2,
        )
        + "\n"
    )
    write_samples(samples, out.with_suffix(".steps.jsonl"))


# ---------------------------------------------------------------- processes
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(*args: str, **kwargs: Any) -> subprocess.Popen:
    path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, __file__, *args], env=env, cwd=REPO_ROOT, **kwargs)


def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the server did not become ready")


# ---------------------------------------------------------------- workload
def server_tiers(url: str, token: str) -> list[TierSpec]:
    """The server's tiers as the simulator's TierSpecs, with CPU-sized lengths."""
    import httpx

    headers = {"authorization": f"Bearer {token}"}
    rows = httpx.get(f"{url}/admin/v1/tiers", headers=headers, timeout=30).json()["data"]
    tiers = []
    for row in rows:
        if row["name"] not in LENGTHS:
            continue
        prompt_len, output_len = LENGTHS[row["name"]]
        tiers.append(
            TierSpec(
                row["name"],
                row["rank"],
                ttft_slo_ms=row["ttft_slo_ms"],
                tpot_slo_ms=row["tpot_slo_ms"],
                min_share=row["min_share"],
                preemptible=row["preemptible"],
                max_queue_ms=row["max_queue_ms"],
                completion_window_s=row["completion_window_s"],
                max_queued_jobs=row["max_queued_jobs"],
                prompt_len=prompt_len,
                output_len=output_len,
            )
        )
    return sorted(tiers, key=lambda t: t.rank)


def workload_spec(tiers: list[TierSpec], rate: float, duration_s: float, seed: int) -> WorkloadSpec:
    tenants = []
    for tier in tiers:
        count = TENANTS_PER_TIER[tier.name]
        for i in range(count):
            share = LOAD_SHARES[tier.name] / count
            tenants.append(TenantSpec(f"{tier.name}-{i}", tier.name, 1.0, share))
    return WorkloadSpec(tuple(tiers), tuple(tenants), rate, duration_s, seed=seed)


def _fleet(params: RooflineParams, max_model_len: int) -> FleetSpec:
    return FleetSpec(params, 1, max_model_len=max_model_len)


def rate_for_load(
    spec: WorkloadSpec, params: RooflineParams, max_model_len: int, load: float
) -> float:
    """The offered rate at which the calibrated engine is busy `load` of the arrival
    period (work per request shrinks as batches grow, hence a few fixed-point rounds)."""
    rate = spec.rate_per_s
    for _ in range(4):
        result = simulate(
            spec.with_rate(rate), "tiered", _fleet(params, max_model_len), SimOptions(drain_s=0.0)
        )
        busy = sum(e.busy_s for e in result.engines) / spec.duration_s
        if busy <= 0:
            break
        rate *= load / busy
    return rate


# ---------------------------------------------------------------- the real replay
@dataclass
class _Sent:
    outcome: Outcome
    lag_s: float  # how late the request left, against its trace time
    sent_s: float = 0.0  # perf_counter
    server_id: str = ""  # x-request-id: the engine's id of the request


def _prompt(request: TraceRequest, text_ids: list[int], seed: int) -> list[int]:
    rng = random.Random(f"{seed}:{request.request_id}")
    return [rng.choice(text_ids) for _ in range(request.num_prompt_tokens)]


def _http_request(port: int, key: str, body: dict) -> bytes:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        f"Host: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {key}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode() + data


async def _send(port: int, request: TraceRequest, key: str, payload: bytes, t0: float) -> _Sent:
    """One streamed completion on a connection of its own: a small HTTP/1.1 client, so
    the load generator spends as little of the machine as it can."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = time.perf_counter()
    writer.write(payload)
    lag = sent - (t0 + request.arrival_s)
    token_times: list[float] = []
    num_tokens = 0
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        server_id = ""
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"x-request-id:"):
                server_id = line.split(b":", 1)[1].strip().decode()
        if status != 200:
            body = await reader.read()
            code = f"http_{status}"
            try:
                start = body.index(b"{")
                code = json.loads(body[start : body.rindex(b"}") + 1])["error"]["code"] or code
            except (ValueError, KeyError, TypeError):
                pass
            return _Sent(Outcome(request.request_id, request.tier, code), lag)
        buffer = b""
        while True:
            size_line = await reader.readline()
            size = int(size_line.strip() or b"0", 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            now = time.perf_counter()
            buffer += data[:-2]
            while b"\n\n" in buffer:
                event, buffer = buffer.split(b"\n\n", 1)
                if not event.startswith(b"data: ") or event == b"data: [DONE]":
                    continue
                chunk = json.loads(event[6:])
                if "error" in chunk:
                    code = chunk["error"].get("code") or "stream_error"
                    return _Sent(Outcome(request.request_id, request.tier, code), lag)
                if chunk.get("usage"):
                    num_tokens = chunk["usage"]["completion_tokens"]
                choices = chunk.get("choices") or []
                if choices and choices[0].get("text"):
                    token_times.append(now)
    finally:
        writer.close()
    if num_tokens != request.max_tokens or not token_times:
        # The harness makes every request run to max_tokens; say so if one did not.
        status_code = f"short_{num_tokens}_of_{request.max_tokens}"
        return _Sent(Outcome(request.request_id, request.tier, status_code), lag)
    ttft, tpot = request_timing(sent, token_times, num_tokens)
    return _Sent(
        Outcome(
            request.request_id,
            request.tier,
            OK,
            ttft,
            tpot,
            num_tokens,
            token_times[-1] - t0,
        ),
        lag,
        sent,
        server_id,
    )


async def replay(
    port: int,
    trace: list[TraceRequest],
    keys: dict[str, str],
    text_ids: list[int],
    seed: int,
) -> list[_Sent]:
    """Open loop: every request leaves at its trace time, whatever came before."""
    payloads = []
    for r in trace:
        body = {
            "model": MODEL,
            "prompt": _prompt(r, text_ids, seed),
            "max_tokens": r.max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        payloads.append(_http_request(port, keys[r.tenant_id], body))
    tasks = []
    t0 = time.perf_counter() + 0.5
    for r, payload in zip(trace, payloads, strict=True):
        delay = t0 + r.arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_send(port, r, keys[r.tenant_id], payload, t0)))
    return list(await asyncio.gather(*tasks))


def _tenant_keys(url: str, token: str, tenants: tuple[TenantSpec, ...]) -> dict[str, str]:
    import httpx

    headers = {"authorization": f"Bearer {token}"}
    keys = {}
    with httpx.Client(base_url=f"{url}/admin/v1", headers=headers, timeout=30) as admin:
        for tenant in tenants:
            # Limits out of the way: this compares scheduling, not rate limiting.
            body = {"name": tenant.tenant_id, "tier": tenant.tier, "weight": tenant.weight}
            body |= {"rpm": 10_000_000, "tpm": 2_000_000_000, "max_concurrency": 100_000}
            created = admin.post("/tenants", json=body)
            created.raise_for_status()
            key = admin.post(f"/tenants/{created.json()['id']}/keys", json={})
            key.raise_for_status()
            keys[tenant.tenant_id] = key.json()["secret"]
    return keys


async def _warm_up(port: int, key: str, text_ids: list[int]) -> None:
    """First requests pay one-time costs, and let the engine measure its rates (which
    admission reads) before the trace starts."""
    warm = [TraceRequest(f"warm-{i}", 0.1 * i, "warm", "interactive", 64, 16) for i in range(20)]
    t0 = time.perf_counter()
    tasks = []
    for r in warm:
        await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
        body = {"model": MODEL, "prompt": _prompt(r, text_ids, 0), "max_tokens": 16}
        body |= {"temperature": 0, "stream": True}
        tasks.append(asyncio.create_task(_send(port, r, key, _http_request(port, key, body), t0)))
    await asyncio.gather(*tasks)
    await asyncio.sleep(2.0)  # the dispatcher publishes its measured rates once a second


# ---------------------------------------------------------------- one comparison
@dataclass
class Calibration:
    """A fitted preset and where its samples came from."""

    # "measure" (calibrate --measure), "serving" (a calibration replay) or "serving,
    # same run" (the measured replay's own steps)
    source: str
    params: RooflineParams
    mean_abs_rel_error: float
    num_samples: int


@dataclass
class RunResult:
    idle_path: RequestPath
    path: RequestPath  # in service, added to every simulated request
    rate_per_s: float
    trace: list[TraceRequest]
    real: Summary
    sims: dict[str, Summary]  # per calibration source
    calibrations: dict[str, Calibration]
    step_fits: dict[str, list[StepFit]]  # the measured replay's steps, per calibration
    decode_cycles: dict[str, list[tuple[int, int, float, float]]]
    lag_p99_ms: float
    lag_max_ms: float
    wall_s: float
    load_avg: tuple[float, float]


def _text_ids() -> list[int]:
    from engine.tokenizer import Tokenizer

    return text_token_ids(Tokenizer(MODEL))


def _measure_calibration(args: argparse.Namespace, path: Path) -> Calibration:
    if args.calibration:
        data = json.loads(Path(args.calibration).read_text())
    else:
        cal = _spawn("--calibrate-out", str(path), "--threads", str(args.threads))
        if cal.wait() != 0:
            raise RuntimeError("calibration failed")
        data = json.loads(path.read_text())
    params = RooflineParams.from_dict(data["params"])
    return Calibration("measure", params, data["mean_abs_rel_error"], data["num_samples"])


def _serving_calibration(
    steps: list[LoggedStep], base: RooflineParams, source: str = "serving"
) -> Calibration:
    """The same roofline fitted to the engine's step cycles in service (averaged per kind
    of step), so that the host work of serving (streaming each token through the event
    loop, the interpreter shared with it) is in the fit."""
    from scheduler.sim.calibrate import mean_by_shape

    samples = mean_by_shape(cycle_samples(steps))
    fit = fit_roofline(base, samples)
    return Calibration(source, fit.params, fit.mean_abs_rel_error, fit.num_samples)


def _read_steps(path: Path, skip: int = 0) -> list[LoggedStep]:
    lines = path.read_text().splitlines()[skip:]
    return [LoggedStep.from_row(json.loads(line)) for line in lines if line.strip()]


def _simulate(
    spec: WorkloadSpec,
    trace: list[TraceRequest],
    calibration: Calibration,
    path: RequestPath,
    args: argparse.Namespace,
) -> Summary:
    result = simulate(
        spec,
        "tiered",
        _fleet(calibration.params, args.max_model_len),
        SimOptions(drain_s=600.0, keep_records=True),
        requests=sim_requests(trace, spec, path),
    )
    return summarize([outcome_of(r, path) for r in result.collector.records])


def _probe_request_path(port: int, key: str, text_ids: list[int], step_log: Path) -> RequestPath:
    """Requests one at a time on the idle server: from each send to the start of its
    prefill step (in the step log, the same monotonic clock), and from that step's end
    to its first token at the client."""
    skip = len(step_log.read_text().splitlines())
    sends = asyncio.run(_probe_sends(port, key, text_ids))
    time.sleep(0.3)
    prefills = [s for s in _read_steps(step_log, skip) if s.num_decodes == 0]
    ingress, egress = [], []
    for send_s, first_s in sends:
        step = next((s for s in prefills if s.start_s >= send_s), None)
        if step is not None and step.end_s <= first_s:
            ingress.append(step.start_s - send_s)
            egress.append(first_s - step.end_s)
    if not ingress:
        return RequestPath()
    return RequestPath(statistics.median(ingress), statistics.median(egress))


async def _probe_sends(port: int, key: str, text_ids: list[int]) -> list[tuple[float, float]]:
    """(send, first token) times of sequential short requests."""
    sends = []
    for i in range(20):
        r = TraceRequest(f"probe-{i}", 0.0, "warm-up", "interactive", 64, 2)
        body = {"model": MODEL, "prompt": _prompt(r, text_ids, i), "max_tokens": 2}
        body |= {"temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        sent = await _send(port, r, key, _http_request(port, key, body), t0)
        if sent.outcome.ttft_s is not None:
            sends.append((t0 + sent.lag_s, t0 + sent.lag_s + sent.outcome.ttft_s))
        await asyncio.sleep(0.1)
    return sends


def run_once(args: argparse.Namespace, index: int, out: Path) -> RunResult:
    started = time.perf_counter()
    load_before = os.getloadavg()[0]
    # 1. calibration, in a process of its own
    measured = _measure_calibration(args, out / f"calibration-{index}.json")
    text_ids = _text_ids()
    # --same-trace: every repeat replays the first one's trace (its seed and rate), so
    # the spread shows how far the real system moves between identical runs.
    seed = args.seed + (0 if args.same_trace else 100 * index)
    token = secrets.token_urlsafe(16)
    step_log = out / f"steps-{index}.jsonl"
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        server = _spawn(
            *("--serve", "--port", str(port), "--data-dir", tmp, f"--admin-token={token}"),
            *("--threads", str(args.threads), "--step-log", str(step_log)),
            stdout=subprocess.DEVNULL,
        )
        try:
            _wait_up(url, server)
            # 2. the workload, on the server's own tiers
            tiers = server_tiers(url, token)
            spec = workload_spec(tiers, 1.0, args.duration, seed)
            rate = args.rate or rate_for_load(spec, measured.params, args.max_model_len, args.load)
            if args.same_trace:
                args.rate = rate
            spec = spec.with_rate(rate)
            trace = trace_of(generate(spec))
            trace_path = out / f"trace-{index}.jsonl"
            write_trace(trace, trace_path)
            trace = read_trace(trace_path.read_text().splitlines())
            keys = _tenant_keys(url, token, spec.tenants)
            warm = TenantSpec("warm-up", "interactive")  # a tenant outside the trace
            warm_key = _tenant_keys(url, token, (warm,))["warm-up"]
            asyncio.run(_warm_up(port, warm_key, text_ids))
            path = _probe_request_path(port, warm_key, text_ids, step_log)
            # 3a. a calibration replay: another draw of the same workload, its step
            # cycles in service fitted (the "serving" calibration)
            cal_spec = replace(spec, seed=seed + 1, duration_s=args.calibration_duration)
            cal_sent = asyncio.run(
                replay(port, trace_of(generate(cal_spec)), keys, text_ids, seed + 1)
            )
            time.sleep(0.5)  # the last steps' log lines
            calibration_steps = _read_steps(step_log)
            serving = _serving_calibration(calibration_steps, measured.params)
            # The request path as it was in that replay (the idle probe's is shorter).
            loaded_path = request_path_in_service(
                [
                    (s.server_id, s.sent_s, s.sent_s + s.outcome.ttft_s)
                    for s in cal_sent
                    if s.outcome.ttft_s is not None
                ],
                calibration_steps,
            )
            # 3b. the measured replay
            sent = asyncio.run(replay(port, trace, keys, text_ids, seed))
            time.sleep(0.5)
            steps = _read_steps(step_log, len(calibration_steps))
        finally:
            server.terminate()
            server.wait(timeout=60)
    real = summarize([s.outcome for s in sent])
    lags = sorted(s.lag_s for s in sent)
    # The same fit to the measured replay's own steps: no prediction, but it shows how
    # much of the error is the machine's speed drifting between calibration and run.
    same_run = _serving_calibration(steps, measured.params, "serving, same run")
    calibrations = {c.source: c for c in (measured, serving, same_run)}
    # 4. the simulator, same trace, once per calibration
    sims = {name: _simulate(spec, trace, c, loaded_path, args) for name, c in calibrations.items()}
    return RunResult(
        path,
        loaded_path,
        rate,
        trace,
        real,
        sims,
        calibrations,
        {name: step_fits(steps, c.params) for name, c in calibrations.items()},
        {name: decode_cycles_by_batch(steps, c.params) for name, c in calibrations.items()},
        lags[int(0.99 * (len(lags) - 1))] * 1000,
        lags[-1] * 1000,
        time.perf_counter() - started,
        (load_before, os.getloadavg()[0]),
    )


def _report(run: RunResult, index: int) -> str:
    lines = [
        f"## run {index}: {len(run.trace)} requests at {run.rate_per_s:.2f}/s "
        f"over {run.trace[-1].arrival_s:.0f} s",
        "",
        f"load generator lateness: p99 {run.lag_p99_ms:.1f} ms, max {run.lag_max_ms:.1f} ms; "
        f"1-min load average {run.load_avg[0]:.2f} before, {run.load_avg[1]:.2f} after; "
        f"{run.wall_s:.0f} s wall",
        f"request path: {run.idle_path.ingress_s * 1000:.2f} ms in, "
        f"{run.idle_path.egress_s * 1000:.2f} ms out on the idle server; "
        f"{run.path.ingress_s * 1000:.2f} ms in, {run.path.egress_s * 1000:.2f} ms out in the "
        "calibration replay (added to every simulated request)",
        "",
    ]
    for name, cal in run.calibrations.items():
        p = cal.params
        checks = compare(run.real, run.sims[name])
        passed = sum(c.passed for c in checks)
        lines += [
            f"### calibrated by {name}",
            "",
            f"fit: overhead {p.overhead_s * 1000:.2f} ms + {p.overhead_per_seq_s * 1000:.2f} ms "
            f"per sequence, memory {p.memory_efficiency:.3f} × "
            f"{p.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s, compute "
            f"{p.compute_efficiency:.3f} × {p.peak_flops_per_s / 1e9:.1f} GFLOP/s, "
            f"mean error {cal.mean_abs_rel_error:.1%} over {cal.num_samples} steps",
            "",
            "measured replay's step cycles: "
            + "; ".join(
                f"{f.kind} {f.num_steps}: {f.measured_ms:.2f} ms measured "
                f"({f.between_steps_ms:.2f} between steps), {f.predicted_ms:.2f} predicted"
                for f in run.step_fits[name]
            ),
            "measured replay's pure decode cycles by sequences per step: "
            + "; ".join(
                f"{b}+: {m:.2f} ms measured, {pr:.2f} predicted ({n} steps)"
                for b, n, m, pr in run.decode_cycles[name]
            ),
            "",
            format_table(checks),
            "",
            f"{passed} of {len(checks)} figures within tolerance",
            "",
        ]
    first = next(iter(run.sims.values()))
    lines += [format_counts(run.real, first), ""]
    return "\n".join(lines)


def _as_json(run: RunResult) -> dict[str, Any]:
    return {
        "rate_per_s": run.rate_per_s,
        "request_path_s": {"ingress": run.path.ingress_s, "egress": run.path.egress_s},
        "idle_request_path_s": {
            "ingress": run.idle_path.ingress_s,
            "egress": run.idle_path.egress_s,
        },
        "num_requests": len(run.trace),
        "lag_p99_ms": run.lag_p99_ms,
        "lag_max_ms": run.lag_max_ms,
        "load_avg": run.load_avg,
        "real": _summary_json(run.real),
        "by_calibration": {
            name: {
                "params": cal.params.to_dict(),
                "mean_abs_rel_error": cal.mean_abs_rel_error,
                "num_samples": cal.num_samples,
                "step_fits": [f.__dict__ for f in run.step_fits[name]],
                "decode_cycles_by_batch": run.decode_cycles[name],
                "sim": _summary_json(run.sims[name]),
                "checks": [
                    {**c.__dict__, "rel_error": c.rel_error, "passed": c.passed}
                    for c in compare(run.real, run.sims[name])
                ],
            }
            for name, cal in run.calibrations.items()
        },
    }


def _summary_json(summary: Summary) -> dict[str, Any]:
    return {
        "output_tokens_per_s": summary.output_tokens_per_s,
        "span_s": summary.span_s,
        "num_output_tokens": summary.num_output_tokens,
        "groups": {k: v.__dict__ for k, v in summary.groups.items()},
    }


def _spread(runs: list[RunResult]) -> str:
    """Per figure and calibration, the relative error of each run: how much the verdict
    moves from run to run on a shared machine."""
    lines = ["## spread over runs", ""]
    if len({tuple(run.trace) for run in runs}) == 1:
        # One trace replayed: the real system against its own first run, the floor
        # under any simulator's error.
        lines += [
            "### the real system against its first run (same trace)",
            "",
            "| group | metric | differences |",
            "|---|---|---|",
        ]
        table = {}
        for run in runs[1:]:
            for d in compare(runs[0].real, run.real):
                table.setdefault((d.group, d.metric), []).append(d)
        for (group, metric), diffs in table.items():
            shown = ", ".join("-" if d.rel_error is None else f"{d.rel_error:+.0%}" for d in diffs)
            lines.append(f"| {group} | {metric} | {shown} |")
        lines.append("")
    for name in runs[0].calibrations:
        table: dict[tuple[str, str], list[Check]] = {}
        for run in runs:
            for c in compare(run.real, run.sims[name]):
                table.setdefault((c.group, c.metric), []).append(c)
        lines += [f"### calibrated by {name}", "", "| group | metric | errors | passes |"]
        lines.append("|---|---|---|---|")
        for (group, metric), checks in table.items():
            shown = ", ".join("-" if c.rel_error is None else f"{c.rel_error:+.0%}" for c in checks)
            passes = sum(c.passed for c in checks)
            lines.append(f"| {group} | {metric} | {shown} | {passes}/{len(checks)} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", type=float, default=0.7, help="busy share of the engine")
    parser.add_argument("--rate", type=float, help="requests/s (instead of --load)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals")
    parser.add_argument(
        "--calibration-duration", type=float, default=40.0, help="seconds of the calibration replay"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="calibrate-replay-simulate runs")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    parser.add_argument("--calibration", help="a calibration JSON of an earlier run (skip it)")
    parser.add_argument(
        "--same-trace", action="store_true", help="every repeat replays the first one's trace"
    )
    parser.add_argument("--max-model-len", type=int, default=2048, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=Path("fidelity-out"))
    # Internal: the server and calibration processes.
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--calibrate-out", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    parser.add_argument("--admin-token", help=argparse.SUPPRESS)
    parser.add_argument("--step-log", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        _serve(args)
        return
    if args.calibrate_out:
        _calibrate(args)
        return

    args.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for index in range(args.repeats):
        run = run_once(args, index, args.out)
        runs.append(run)
        text = _report(run, index)
        print(text, flush=True)
        (args.out / f"report-{index}.md").write_text(text + "\n")
        (args.out / f"result-{index}.json").write_text(json.dumps(_as_json(run), indent=2) + "\n")
    if len(runs) > 1:
        spread = _spread(runs)
        print(spread)
        (args.out / "spread.md").write_text(spread + "\n")


if __name__ == "__main__":
    main()
