"""A batch line may carry no larger a body than a live request (max_body_bytes).

Before, a line had no bound of its own but the input file's (200 MiB): a tenant could
upload one line of empty chat messages, and the gateway parsed it whole (a 20 MB line took
2.3 GB and 17 s of CPU; 200 MB would have taken the process down), then parsed it again
to run it, though the live endpoint answers such a body 413 unread.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from gateway.batches.validation import LINE_ENVELOPE_BYTES

if TYPE_CHECKING:
    import openai

    from tests.gateway.conftest import LiveServer

MODEL = "tiny-random"
CHAT = "/v1/chat/completions"
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def _client(server: LiveServer) -> openai.OpenAI:
    with server.admin() as admin:
        tenant = admin.post(
            "/tenants", json={"name": f"s-{uuid.uuid4().hex[:10]}", "tier": "batch"}
        )
        tenant.raise_for_status()
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
    return server.client(key.json()["secret"])


def _line(custom_id: str, messages: list[dict[str, str]]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body})


def _run(client: openai.OpenAI, lines: list[str]) -> Any:
    content = "".join(line + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("input.jsonl", content), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint=CHAT, completion_window="24h")
    deadline = time.monotonic() + 120
    while batch.status not in TERMINAL:
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    return batch


def test_a_line_larger_than_a_request_body_fails_validation_unparsed(
    live_server: LiveServer,
) -> None:
    client = _client(live_server)
    empty = {"role": "user", "content": ""}
    # Many times the server's max_body_bytes (64 KiB in the tests), all in one line.
    huge = _line("huge", [empty] * (8 * live_server.max_body_bytes // len(json.dumps(empty))))
    assert len(huge) > 4 * live_server.max_body_bytes
    batch = _run(client, [_line("good", [{"role": "user", "content": "hi"}]), huge])
    assert batch.status == "failed", batch
    error = batch.errors.data[0]
    assert (error.code, error.line, error.param) == ("line_too_large", 2, "body")
    assert str(live_server.max_body_bytes) in error.message
    assert batch.request_counts.total == 0  # nothing ran, the good line neither


def test_a_line_within_the_body_limit_still_runs(live_server: LiveServer) -> None:
    client = _client(live_server)
    # A body just under max_body_bytes, with a long custom_id of escaped characters: the
    # envelope around the body is allowed for.
    content = "x" * (live_server.max_body_bytes - 1024)
    line = json.loads(_line("c", [{"role": "user", "content": content}]))
    line["custom_id"] = "\u2603" * 500
    raw = json.dumps(line)  # ensure_ascii: 6 bytes a character in the custom_id
    assert len(raw) > live_server.max_body_bytes
    assert len(raw) < live_server.max_body_bytes + LINE_ENVELOPE_BYTES
    batch = _run(client, [raw])
    assert batch.status == "completed", batch.errors
    assert batch.request_counts.total == 1
