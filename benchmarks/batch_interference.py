"""Does a big batch hurt interactive traffic? SLO attainment and batch throughput, one run.

One real `tiergate serve` process (built-in model unless --model says otherwise), three
phases against it:

1. interactive alone: one tenant streams chat requests at a steady rate;
2. batch alone: an N-line batch (default 5,000) runs to completion;
3. both: the same batch again while the interactive tenant sends the same traffic.

Reported: the interactive tier's SLO attainment (TTFT and TPOT within the tier's SLOs,
refusals count as misses) alone and with the batch, and the batch's output tokens/s
with interactive traffic as a share of its solo throughput.
Goal: attainment drops by at most 1 percentage point; the batch keeps >= 70 %.

    python benchmarks/batch_interference.py [--num-lines 5000] [--rate 4] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

MODEL_DEFAULT = "tiny-random"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


@dataclass
class Sample:
    status: int
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    num_tokens: int = 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start_server(
    args: argparse.Namespace, data_dir: Path, token: str
) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = {
        **os.environ,
        "TIERGATE_DATA_DIR": str(data_dir),
        "TIERGATE_ADMIN_TOKEN": token,
        "TIERGATE_MODEL": args.model,
        "TIERGATE_DEVICE": args.device,
    }
    if args.database_url:
        env["TIERGATE_DATABASE_URL"] = args.database_url
    if args.max_model_len:
        env["TIERGATE_MAX_MODEL_LEN"] = str(args.max_model_len)
    log = (data_dir / "server.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError((data_dir / "server.log").read_text()[-3000:])
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError("the server did not start")


def _tenant(url: str, token: str, tier: str) -> str:
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(base_url=f"{url}/admin/v1", headers=headers, timeout=30) as admin:
        # Limits out of the way: this measures scheduling, not rate limiting.
        body = {"name": f"bench-{tier}-{secrets.token_hex(4)}", "tier": tier}
        body |= {"rpm": 10_000_000, "tpm": 2_000_000_000, "max_concurrency": 100_000}
        tenant = admin.post("/tenants", json=body)
        tenant.raise_for_status()
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
        return key.json()["secret"]


def _slos(url: str, token: str) -> tuple[float, float]:
    headers = {"authorization": f"Bearer {token}"}
    tier = httpx.get(f"{url}/admin/v1/tiers/interactive", headers=headers, timeout=30).json()
    return tier["ttft_slo_ms"], tier["tpot_slo_ms"]


async def _one_interactive(
    client: httpx.AsyncClient, model: str, max_tokens: int, i: int
) -> Sample:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"Interactive question {i}?"}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    num_tokens = 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return Sample(response.status_code)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if choices and choices[0].get("delta", {}).get("content"):
                    num_tokens += 1
                    if first is None:
                        first = time.perf_counter()
    except httpx.HTTPError:
        return Sample(0)
    end = time.perf_counter()
    if first is None:
        return Sample(200)
    ttft_ms = (first - started) * 1000
    tpot_ms = (end - first) * 1000 / (num_tokens - 1) if num_tokens > 1 else 0.0
    return Sample(200, ttft_ms, tpot_ms, num_tokens)


async def _interactive(
    url: str, key: str, args: argparse.Namespace, stop: asyncio.Event | None, duration_s: float
) -> list[Sample]:
    """Steady traffic for duration_s (and, with `stop`, until it is set)."""
    headers = {"authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=120, limits=limits
    ) as client:
        tasks = []
        started = time.perf_counter()
        i = 0
        while True:
            elapsed = time.perf_counter() - started
            if elapsed >= duration_s and (stop is None or stop.is_set()):
                break
            tasks.append(
                asyncio.create_task(_one_interactive(client, args.model, args.max_tokens, i))
            )
            i += 1
            await asyncio.sleep(max(0.0, started + i / args.rate - time.perf_counter()))
        return list(await asyncio.gather(*tasks))


def _batch_input(args: argparse.Namespace) -> bytes:
    lines = []
    for i in range(args.num_lines):
        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": f"Summarise document {i} in a line."}],
            "max_tokens": args.batch_max_tokens,
            "temperature": 0,
        }
        lines.append(
            {"custom_id": f"doc-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        )
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def _run_batch(url: str, key: str, content: bytes, done: asyncio.Event | None) -> dict:
    """Submit, follow, and measure output tokens/s from in_progress to the end."""
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=f"{url}/v1", headers=headers, timeout=300) as client:
        uploaded = (
            await client.post(
                "/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}
            )
        ).json()
        body = {
            "input_file_id": uploaded["id"],
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        }
        batch = (await client.post("/batches", json=body)).json()
        running_since: float | None = None
        while True:
            batch = (await client.get(f"/batches/{batch['id']}")).json()
            now = time.perf_counter()
            if running_since is None and batch["status"] != "validating":
                running_since = now
            if batch["status"] in TERMINAL:
                break
            await asyncio.sleep(0.2)
        if done is not None:
            done.set()
        elapsed_s = now - (running_since or now)
        tokens = batch["usage"]["output_tokens"]
        return {
            "status": batch["status"],
            "request_counts": batch["request_counts"],
            "output_tokens": tokens,
            "elapsed_s": round(elapsed_s, 2),
            "tokens_per_s": round(tokens / elapsed_s, 1) if elapsed_s > 0 else None,
        }


def _attainment(samples: list[Sample], ttft_slo_ms: float, tpot_slo_ms: float) -> dict:
    ok = [s for s in samples if s.status == 200 and s.ttft_ms is not None]
    ttft_missed = sum(1 for s in ok if s.ttft_ms > ttft_slo_ms)
    tpot_missed = sum(1 for s in ok if (s.tpot_ms or 0.0) > tpot_slo_ms)
    met = sum(1 for s in ok if s.ttft_ms <= ttft_slo_ms and (s.tpot_ms or 0.0) <= tpot_slo_ms)
    ttfts = sorted(s.ttft_ms for s in ok)
    tpots = sorted(s.tpot_ms or 0.0 for s in ok)
    return {
        "num_requests": len(samples),
        "num_refused_or_failed": len(samples) - len(ok),
        "attainment": round(met / len(samples), 4) if samples else None,
        # Which SLO the misses broke (a request may break both).
        "num_ttft_missed": ttft_missed,
        "num_tpot_missed": tpot_missed,
        "ttft_p50_ms": _percentile(ttfts, 0.5),
        "ttft_p99_ms": _percentile(ttfts, 0.99),
        "tpot_p50_ms": _percentile(tpots, 0.5),
        "tpot_p99_ms": _percentile(tpots, 0.99),
    }


def _percentile(values: list[float], q: float) -> float | None:
    return round(values[min(len(values) - 1, int(len(values) * q))], 1) if values else None


def _set_slos(url: str, token: str, ttft_slo_ms: float | None, tpot_slo_ms: float | None) -> None:
    """Give the interactive tier the SLOs this machine can be held to (the engine and
    admission then work to them as well)."""
    changes = {}
    if ttft_slo_ms is not None:
        changes["ttft_slo_ms"] = ttft_slo_ms
    if tpot_slo_ms is not None:
        changes["tpot_slo_ms"] = tpot_slo_ms
    if changes:
        headers = {"authorization": f"Bearer {token}"}
        httpx.patch(
            f"{url}/admin/v1/tiers/interactive", json=changes, headers=headers, timeout=30
        ).raise_for_status()


async def _measure(url: str, token: str, args: argparse.Namespace) -> dict:
    _set_slos(url, token, args.ttft_slo_ms, args.tpot_slo_ms)
    ttft_slo_ms, tpot_slo_ms = _slos(url, token)
    load_before = os.getloadavg()
    interactive_key = _tenant(url, token, "interactive")
    batch_key = _tenant(url, token, "batch")
    content = _batch_input(args)
    # Warm-up: first requests pay one-time costs (allocations, kernels).
    await _interactive(url, interactive_key, args, None, 2.0)

    alone = await _interactive(url, interactive_key, args, None, args.duration_s)
    solo = await _run_batch(url, batch_key, content, None)
    done = asyncio.Event()
    mixed_batch, mixed = await asyncio.gather(
        _run_batch(url, batch_key, content, done),
        _interactive(url, interactive_key, args, done, args.duration_s),
    )
    result = {
        "num_lines": args.num_lines,
        # 1/5/15-minute load averages: what else this machine ran meanwhile.
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "model": args.model,
        "device": args.device,
        "interactive_rate_per_s": args.rate,
        "slo_ms": {"ttft": ttft_slo_ms, "tpot": tpot_slo_ms},
        "interactive_alone": _attainment(alone, ttft_slo_ms, tpot_slo_ms),
        "interactive_with_batch": _attainment(mixed, ttft_slo_ms, tpot_slo_ms),
        "batch_alone": solo,
        "batch_with_interactive": mixed_batch,
    }
    a0 = result["interactive_alone"]["attainment"] or 0.0
    a1 = result["interactive_with_batch"]["attainment"] or 0.0
    result["attainment_drop_pp"] = round((a0 - a1) * 100, 2)
    if solo["tokens_per_s"] and mixed_batch["tokens_per_s"]:
        result["batch_throughput_kept"] = round(
            mixed_batch["tokens_per_s"] / solo["tokens_per_s"], 3
        )
    result["goals_met"] = {
        "attainment_drop_at_most_1pp": result["attainment_drop_pp"] <= 1.0,
        "batch_keeps_70_percent": result.get("batch_throughput_kept", 0.0) >= 0.7,
    }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-lines", type=int, default=5_000)
    parser.add_argument("--batch-max-tokens", type=int, default=32)
    parser.add_argument("--rate", type=float, default=4.0, help="interactive requests per second")
    parser.add_argument("--max-tokens", type=int, default=32, help="per interactive request")
    parser.add_argument("--duration-s", type=float, default=30.0, help="interactive-alone phase")
    parser.add_argument("--ttft-slo-ms", type=float, help="set the interactive tier's TTFT SLO")
    parser.add_argument("--tpot-slo-ms", type=float, help="set the interactive tier's TPOT SLO")
    parser.add_argument("--model", default=MODEL_DEFAULT)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--database-url", help="default: a SQLite file in a temporary folder")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()

    token = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory() as tmp:
        process, url = _start_server(args, Path(tmp), token)
        try:
            result = asyncio.run(_measure(url, token, args))
        finally:
            process.terminate()
            process.wait(timeout=60)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
