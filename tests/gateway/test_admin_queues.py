"""GET /admin/v1/queues on a live server (one process: the in-memory queue and its own
worker): fleet totals and the per-worker list, idle and under load."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from engine.config import EngineConfig
from tests.gateway.conftest import LiveServer

WORKER_FIELDS = {
    "id",
    "heartbeat_age_ms",
    "prefill_tokens_per_s",
    "decode_tokens_per_s",
    "num_running",
    "num_waiting",
    "num_free_seqs",
    "next_release_ms",
    "num_preemptible_seqs",
    "kv_cache_usage",
    "step_token_budget",
    "num_preemptions",
    "num_recomputed_tokens",
    "backlog_prefill_tokens",
    "backlog_decode_tokens",
}


def _queues(server: LiveServer) -> dict:
    with server.admin() as admin:
        reply = admin.get("/queues")
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_queues_list_the_worker_of_an_idle_server(live_server: LiveServer) -> None:
    body = _queues(live_server)
    assert body["object"] == "queues"
    workers = body["workers"]
    [worker] = workers["data"]
    assert set(worker) == WORKER_FIELDS
    assert workers["live"] == 1
    # The list and the fleet totals come from the same reports.
    assert worker["prefill_tokens_per_s"] == workers["prefill_tokens_per_s"] > 0
    assert worker["decode_tokens_per_s"] == workers["decode_tokens_per_s"] > 0
    # Idle: every sequence slot is free, and admission knows it.
    assert worker["num_free_seqs"] == workers["num_free_seqs"] == EngineConfig().max_num_seqs
    assert worker["next_release_ms"] is None  # nothing runs
    assert worker["num_preemptible_seqs"] == 0
    # Reported every second; a report this old would have lapsed (5 s) already.
    assert 0 <= worker["heartbeat_age_ms"] < 5_000
    assert 0.0 <= worker["kv_cache_usage"] <= 1.0
    assert (worker["num_running"], worker["num_waiting"]) == (0, 0)  # nothing sent yet
    assert worker["step_token_budget"] > 0
    assert (worker["num_preemptions"], worker["num_recomputed_tokens"]) == (0, 0)
    assert (worker["backlog_prefill_tokens"], worker["backlog_decode_tokens"]) == (0, 0)


def test_queues_list_running_sequences_under_load(live_server: LiveServer) -> None:
    seen: list[dict] = []

    async def scenario() -> None:
        client = openai.AsyncOpenAI(
            base_url=f"{live_server.base_url}/v1",
            api_key=live_server.keys["interactive"],
            max_retries=0,
        )
        stop = asyncio.Event()

        async def load() -> None:
            while not stop.is_set():
                await client.completions.create(
                    model="tiny-random", prompt="hello there", max_tokens=120, temperature=0
                )

        async def watch() -> None:
            # Keep the engine busy until a heartbeat's report shows it (at most 30 s).
            deadline_s = time.monotonic() + 30.0
            try:
                async with httpx.AsyncClient(
                    base_url=f"{live_server.base_url}/admin/v1",
                    headers={"authorization": f"Bearer {live_server.admin_token}"},
                ) as admin:
                    while time.monotonic() < deadline_s:
                        [worker] = (await admin.get("/queues")).json()["workers"]["data"]
                        seen.append(worker)
                        if worker["num_running"] and worker["backlog_decode_tokens"]:
                            return
                        await asyncio.sleep(0.1)
            finally:
                stop.set()

        try:
            await asyncio.gather(watch(), *(load() for _ in range(4)))
        finally:
            await client.close()

    asyncio.run(scenario())
    busy = seen[-1]
    assert busy["num_running"] >= 1, seen
    assert busy["kv_cache_usage"] > 0.0
    # Tokens its engine still has to generate for the running requests.
    assert 0 < busy["backlog_decode_tokens"] <= 4 * 120
