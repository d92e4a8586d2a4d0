"""The cost of observability: gateway requests/s with metrics and tracing on vs off.

Two gateways run side by side in one run, each in its own process, both the real app
with the null model runner of benchmarks/gateway_overhead.py (so the model's compute is
out of the picture and the gateway's own cost is all there is):

- on: metrics on, and every request's span tree exported over OTLP/HTTP to a local
  sink process (a real exporter doing real work), with /metrics scraped every second;
- off: OTEL_SDK_DISABLED=true.

Each round runs both, in an order that alternates between rounds, to spread drift on a
shared machine; the report is the median of the rounds' on/off ratios, beside the
median requests/s of each (goal: on >= 0.90 x off).

    python benchmarks/observability_overhead.py [--rounds 3] [--duration-s 5] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:] = [str(_HERE.parent)] + [p for p in sys.path if Path(p or ".").resolve() != _HERE]


def _harness():
    """benchmarks/gateway_overhead.py, loaded by path (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("gateway_overhead", _HERE / "gateway_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _serve_sink(port: int) -> None:
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def traces(request: Request) -> Response:
        await request.body()
        return Response(b"", media_type="application/x-protobuf")

    app = Starlette(routes=[Route("/v1/traces", traces, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _spawn(env: dict[str, str], *args: str) -> subprocess.Popen:
    root = str(_HERE.parent)
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return subprocess.Popen(
        [sys.executable, *args], env={**os.environ, "PYTHONPATH": path, **env}, cwd=root
    )


def _scrape_every(port: int, interval_s: float, stop: threading.Event) -> None:
    import httpx

    with httpx.Client() as client:
        while not stop.wait(interval_s):
            client.get(f"http://127.0.0.1:{port}/metrics").raise_for_status()


def _make_key(port: int, admin_token: str) -> str:
    """A key of a tenant on an unlimited tier without SLOs: admission never refuses it,
    so the run measures serving, not "not now" answers."""
    import httpx

    with httpx.Client(
        base_url=f"http://127.0.0.1:{port}/admin/v1",
        headers={"authorization": f"Bearer {admin_token}"},
    ) as admin:
        admin.post("/tiers", json={"name": "bench", "rank": 5}).raise_for_status()
        tenant = admin.post("/tenants", json={"name": "bench", "tier": "bench"})
        tenant.raise_for_status()
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
        return key.json()["secret"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--no-tracing", action="store_true", help="'on' keeps metrics but exports no spans"
    )
    parser.add_argument("--serve-sink", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_sink:
        _serve_sink(args.serve_sink)
        return

    h = _harness()
    admin_token = secrets.token_urlsafe(16)
    sink_port, on_port, off_port = h._free_port(), h._free_port(), h._free_port()
    gateway = str(_HERE / "gateway_overhead.py")
    procs: list[subprocess.Popen] = []
    rates: dict[str, list[float]] = {"off": [], "on": []}
    cpu: dict[str, list[float]] = {"off": [], "on": []}  # gateway CPU us per request
    with tempfile.TemporaryDirectory() as tmp:
        try:
            procs.append(_spawn({}, __file__, "--serve-sink", str(sink_port)))
            on_env = {"OTEL_SDK_DISABLED": "false"}
            if not args.no_tracing:
                on_env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{sink_port}"
            for name, port, env in (
                ("on", on_port, on_env),
                ("off", off_port, {"OTEL_SDK_DISABLED": "true"}),
            ):
                data_dir = Path(tmp) / name
                data_dir.mkdir()
                procs.append(
                    _spawn(
                        env,
                        gateway,
                        "--serve",
                        "gateway",
                        "--port",
                        str(port),
                        "--arg",
                        str(data_dir),
                        f"--admin-token={admin_token}",  # it may start with "-"
                    )
                )
            for port, proc in ((sink_port, procs[0]), (on_port, procs[1]), (off_port, procs[2])):
                h._wait_up(port, proc)
            requests = {
                name: h._request_bytes(port, _make_key(port, admin_token))
                for name, port in (("on", on_port), ("off", off_port))
            }
            ports = {"on": on_port, "off": off_port}
            pids = {"on": procs[1].pid, "off": procs[2].pid}
            for name in ("off", "on"):  # warm-up
                asyncio.run(h.max_rate(ports[name], requests[name], args.concurrency, 1.0))
            for round_index in range(args.rounds):
                # Which side goes first alternates (off-on, on-off, ...): the second run
                # of a pair inherits the first's after-effects on a shared machine.
                order = ("off", "on") if round_index % 2 == 0 else ("on", "off")
                for name in order:
                    stop = threading.Event()
                    scraper = threading.Thread(
                        target=_scrape_every, args=(ports[name], 1.0, stop), daemon=True
                    )
                    scraper.start()
                    rate, cpu_us = h.measure_rate(
                        ports[name], pids[name], requests[name], args.concurrency, args.duration_s
                    )
                    stop.set()
                    scraper.join()
                    rates[name].append(rate)
                    cpu[name].append(cpu_us)
                    time.sleep(0.5)
        finally:
            for proc in reversed(procs):  # the sink last: the gateways flush their spans to it
                proc.terminate()
                proc.wait(timeout=30)

    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    ratio = statistics.median(a / b for a, b in zip(rates["on"], rates["off"], strict=True))
    print(
        f"non-streaming completions, max_tokens={h.MAX_TOKENS}, null model runner, "
        f"concurrency {args.concurrency}, {args.rounds} x {args.duration_s:.0f} s rounds"
    )
    print("off rounds req/s: " + ", ".join(f"{r:.0f}" for r in rates["off"]))
    print("on  rounds req/s: " + ", ".join(f"{r:.0f}" for r in rates["on"]))
    print(f"median req/s: off {off:.0f}, on {on:.0f}")
    print(
        f"median of the rounds' on/off: {ratio:.3f} "
        f"({(1 - ratio) * 100:.1f}% fewer req/s; goal <= 10%)"
    )
    # The same comparison by the gateway's own CPU time, which the load of other
    # processes on a shared machine does not skew: req/s per core is 1e6 / (CPU us/req).
    cpu_ratio = statistics.median(b / a for a, b in zip(cpu["on"], cpu["off"], strict=True))
    print("off rounds gateway CPU us/req: " + ", ".join(f"{c:.0f}" for c in cpu["off"]))
    print("on  rounds gateway CPU us/req: " + ", ".join(f"{c:.0f}" for c in cpu["on"]))
    print(
        f"median of the rounds' CPU-per-request off/on: {cpu_ratio:.3f} "
        f"({(1 - cpu_ratio) * 100:.1f}% fewer req per CPU-second)"
    )


if __name__ == "__main__":
    main()
