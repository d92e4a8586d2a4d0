"""Simulator scale: 64 engines, 1,000 tenants, one simulated hour at 1,000 requests/s.

Runs the real tiered queue and 64 real step schedulers (H200 + Llama-3.1-8B preset) on
the virtual clock, with pure-decode stretches fast-forwarded, and reports the wall time,
the simulated-seconds-per-wall-second rate and the headline numbers of the run.

    python benchmarks/simulate_scale.py                 # the full hour
    python benchmarks/simulate_scale.py --duration 60   # a one-minute slice
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from scheduler.sim.cost_model import load_params
from scheduler.sim.fleet import POLICIES, FleetSpec, SimOptions, simulate
from scheduler.sim.workload import many_tenants_mix


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", type=int, default=64)
    parser.add_argument("--tenants", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=1000.0, help="requests per second")
    parser.add_argument("--duration", type=float, default=3600.0, help="simulated seconds")
    parser.add_argument("--drain", type=float, default=60.0)
    parser.add_argument("--policy", choices=POLICIES, default="tiered")
    parser.add_argument("--preset", default="h200-llama-3.1-8b")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()

    params = load_params(args.preset)
    spec = many_tenants_mix(args.rate, args.duration, args.tenants, seed=args.seed)
    options = SimOptions(
        drain_s=args.drain,
        sample_interval_s=10.0,
        charge_interval_s=1.0,
        fast_forward=True,
    )
    started = time.perf_counter()
    cpu_started = time.process_time()
    last = [started]

    def progress(now_s: float) -> None:
        # CPU seconds next to wall seconds: on a shared machine the wall clock also
        # measures everyone else's load.
        wall = time.perf_counter()
        if wall - last[0] >= 30 or now_s == 0:
            last[0] = wall
            cpu = time.process_time() - cpu_started
            rate = now_s / cpu if cpu > 0 else 0.0
            total = args.duration + args.drain
            eta = (total - now_s) / rate if rate > 0 else float("nan")
            print(
                f"simulated {now_s:7.0f} s of {total:.0f}  wall {wall - started:7.0f} s  "
                f"cpu {cpu:7.0f} s  {rate:.3f} sim-s/cpu-s  cpu eta {eta:6.0f} s",
                file=sys.stderr,
                flush=True,
            )

    result = simulate(
        spec, args.policy, FleetSpec(params, args.engines), options, on_progress=progress
    )
    wall_s = time.perf_counter() - started
    cpu_s = time.process_time() - cpu_started
    stats = result.stats
    offered = sum(t.num_offered for t in stats.tiers.values())
    summary = {
        "engines": args.engines,
        "tenants": args.tenants,
        "rate_per_s": args.rate,
        "simulated_s": args.duration + args.drain,
        "policy": args.policy,
        "wall_s": round(wall_s, 1),
        "cpu_s": round(cpu_s, 1),
        "simulated_s_per_wall_s": round((args.duration + args.drain) / wall_s, 3),
        "requests_offered": offered,
        "engine_steps": stats.num_steps,
        "output_tokens_per_s": round(stats.output_tokens_per_s),
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        "attainment": {name: t.attainment for name, t in sorted(stats.tiers.items())},
        "ttft_p99_ms": {name: t.ttft_p99_ms for name, t in sorted(stats.tiers.items())},
        "preemptions": stats.num_preemptions,
    }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key, value in summary.items():
            print(f"{key:24} {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
