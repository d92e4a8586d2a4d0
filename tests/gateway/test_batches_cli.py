"""`tiergate batch submit|status|results|cancel` against a live server."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from gateway.batch_cli import (
    ApiError,
    BatchClient,
    lines_ran_since,
    progress_line,
    submit_batch,
)
from gateway.cli import main

if TYPE_CHECKING:
    from tests.gateway.conftest import LiveServer


def _key(server: LiveServer) -> str:
    with server.admin() as admin:
        tenant = admin.post(
            "/tenants", json={"name": f"cli-{uuid.uuid4().hex[:8]}", "tier": "batch"}
        )
        tenant.raise_for_status()
        key = admin.post(f"/tenants/{tenant.json()['id']}/keys", json={})
        key.raise_for_status()
        return key.json()["secret"]


def _input(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "in.jsonl"
    lines = []
    for i in range(n):
        body = {"model": "tiny-random", "prompt": f"Row {i}", "max_tokens": 3, "temperature": 0}
        lines.append(
            {"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions", "body": body}
        )
    lines.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny-random", "prompt": "x", "max_tokens": 100_000},
        }
    )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_submit_wait_results_status_cancel(
    live_server: LiveServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = ["--url", live_server.base_url, "--api-key", _key(live_server)]
    path = _input(tmp_path, 5)
    code = main(
        [
            "batch",
            "submit",
            str(path),
            "--endpoint",
            "/v1/completions",
            "--wait",
            "--poll-s",
            "0.05",
            "--metadata",
            "run=cli",
            *flags,
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    batch = json.loads(captured.out)
    assert batch["status"] == "completed"
    assert batch["metadata"] == {"run": "cli"}
    assert "6/6 done (1 failed)" in captured.err  # the last progress line

    assert main(["batch", "status", batch["id"], *flags]) == 0
    assert json.loads(capsys.readouterr().out)["request_counts"]["completed"] == 5
    # Following again (after a Ctrl-C of --wait): the bar, then the batch, as --wait.
    assert main(["batch", "status", batch["id"], "--wait", "--poll-s", "0.05", *flags]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "completed"
    assert "6/6 done (1 failed) 0.0 req/s" in captured.err  # nothing ran while it watched

    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    assert (
        main(["batch", "results", batch["id"], "-o", str(out), "--errors", str(errors), *flags])
        == 0
    )
    assert sorted(json.loads(x)["custom_id"] for x in out.read_text().splitlines()) == [
        f"r{i}" for i in range(5)
    ]
    [error] = [json.loads(x) for x in errors.read_text().splitlines()]
    assert error["custom_id"] == "bad"
    assert error["response"]["status_code"] == 400
    both = tmp_path / "both.jsonl"
    assert main(["batch", "results", batch["id"], "-o", str(both), *flags]) == 0
    assert len(both.read_text().splitlines()) == 6
    capsys.readouterr()

    # A finished batch cannot be cancelled: the API's 409 is printed, exit status 1.
    assert main(["batch", "cancel", batch["id"], *flags]) == 1
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "batch_not_active"


def test_errors_and_usage(live_server: LiveServer, tmp_path: Path, capsys) -> None:
    path = _input(tmp_path, 1)
    base = ["--url", live_server.base_url]
    assert main(["batch", "status", "batch_nope", *base, "--api-key", _key(live_server)]) == 1
    assert json.loads(capsys.readouterr().err)["error"]["code"] == "batch_not_found"
    assert main(["batch", "submit", str(path), *base, "--api-key", "tg-" + "x" * 43]) == 1
    capsys.readouterr()
    # It starts with tg-, so "expected 'Authorization: Bearer tg-...'" read as a riddle.
    assert main(["batch", "status", "batch_x", *base, "--api-key", "tg-wrong"]) == 1
    error = json.loads(capsys.readouterr().err)["error"]
    assert (error["code"], error["message"]) == (
        "invalid_api_key",
        "Malformed API key: a tiergate key is 'tg-' and 43 to 256 letters, digits, '_' or '-'.",
    )
    assert main(["batch", "submit", str(tmp_path / "missing.jsonl"), *base, "--api-key", "k"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["batch", "submit", str(tmp_path), *base, "--api-key", "k"]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["batch", "submit", "/dev/null", *base, "--api-key", "k"]) == 2
    assert "/dev/null is not a regular file" in capsys.readouterr().err
    assert main(["batch", "submit", str(path), *base, "--api-key", "tg-key\n"]) == 2
    assert "printable ASCII with no spaces" in capsys.readouterr().err
    assert main(["batch", "status", "batch_\udcff", *base, "--api-key", "k"]) == 2
    assert "the batch id is not UTF-8 text" in capsys.readouterr().err
    unreachable = ["--url", "http://127.0.0.1:9", "--api-key", "k", "--timeout-s", "2"]
    assert main(["batch", "status", "batch_x", *unreachable]) == 2
    # Seconds past what the clocks take (an OverflowError traceback before, with --poll-s
    # after the batch was made): an argument error before anything is sent.
    for flag in ("--timeout-s", "--poll-s"):
        with pytest.raises(SystemExit) as exited:
            main(["batch", "submit", str(path), *base, "--api-key", "k", "--wait", flag, "1e12"])
        assert exited.value.code == 2
        assert "at most 1,000,000" in capsys.readouterr().err


def test_progress_line() -> None:
    line = progress_line("in_progress", 10, 2, 40, 4.0, 12)
    assert line.startswith("[#########" + "-" * 21 + "] 12/40 done (2 failed)")
    assert "3.0 req/s" in line
    assert "ETA 0:00:09" in line
    assert "ETA --:--:--" in progress_line("validating", 0, 0, 0, 1.0, 0)


def _polled(status: str, completed: int, failed: int) -> dict:
    return {"status": status, "request_counts": {"completed": completed, "failed": failed}}


def test_lines_closed_unrun_are_not_throughput() -> None:
    """A cancelled batch's unrun lines count as failed: `60/60 done (60 failed) 10.8 req/s`
    took them for lines that ran."""
    assert lines_ran_since(_polled("in_progress", 3, 1), _polled("in_progress", 7, 2)) == 5
    assert lines_ran_since(_polled("in_progress", 7, 2), _polled("completed", 9, 3)) == 3
    for ending in ("cancelling", "cancelled", "expired", "failed"):
        assert lines_ran_since(_polled("in_progress", 7, 2), _polled(ending, 8, 52)) == 1


def test_status_wait_follows_a_cancelled_batch_and_exits_1(
    live_server: LiveServer, tmp_path: Path, capsys
) -> None:
    flags = ["--url", live_server.base_url, "--api-key", _key(live_server)]
    path = _input(tmp_path, 20)
    assert main(["batch", "submit", str(path), "--endpoint", "/v1/completions", *flags]) == 0
    batch_id = json.loads(capsys.readouterr().out)["id"]
    assert main(["batch", "cancel", batch_id, *flags]) == 0
    capsys.readouterr()
    assert main(["batch", "status", batch_id, "--wait", "--poll-s", "0.05", *flags]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "cancelled"
    assert "21/21 done" in captured.err
    assert "cancelled" in captured.err.splitlines()[-1]


def test_results_of_a_failed_batch_say_why_and_exit_1(
    live_server: LiveServer, tmp_path: Path, capsys
) -> None:
    flags = ["--url", live_server.base_url, "--api-key", _key(live_server)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    assert main(["batch", "submit", str(bad), "--wait", "--poll-s", "0.1", *flags]) == 1
    batch_id = json.loads(capsys.readouterr().out)["id"]
    out = tmp_path / "out.jsonl"
    assert main(["batch", "results", batch_id, "-o", str(out), *flags]) == 1
    err = capsys.readouterr().err
    assert "failed" in err
    assert "line 1: invalid_json_line" in err
    # Writing to a folder that is not there: a message, not a traceback.
    good = _input(tmp_path, 1)
    submit = ["batch", "submit", str(good), "--endpoint", "/v1/completions", "--wait"]
    assert main([*submit, "--poll-s", "0.1", *flags]) == 0
    batch_id = json.loads(capsys.readouterr().out)["id"]
    missing = tmp_path / "no" / "such" / "dir.jsonl"
    assert main(["batch", "results", batch_id, "-o", str(missing), *flags]) == 1
    assert "cannot write the results" in capsys.readouterr().err
    # -o and --errors on one file: the errors replaced the results before, and it said
    # it wrote both.
    same = tmp_path / "same.jsonl"
    results = [
        "batch",
        "results",
        batch_id,
        "-o",
        str(same),
        "--errors",
        f"{tmp_path}/./same.jsonl",
    ]
    assert main([*results, *flags]) == 2
    assert "name the same file" in capsys.readouterr().err
    assert not same.exists()


def _file_ids(server: LiveServer, key: str) -> list[str]:
    with server.client(key) as client:
        return [f.id for f in client.files.list()]


def test_metadata_the_api_refuses_is_refused_before_the_upload(
    live_server: LiveServer, tmp_path: Path, capsys
) -> None:
    """The file was uploaded, then the batch refused (400), and the file stayed behind,
    counted against the tenant's file quota."""
    key = _key(live_server)
    flags = ["--url", live_server.base_url, "--api-key", key]
    path = _input(tmp_path, 1)
    for metadata in (["k=" + "v" * 513], ["k" * 65 + "=v"], [f"k{i}=v" for i in range(17)]):
        pairs = [arg for pair in metadata for arg in ("--metadata", pair)]
        assert main(["batch", "submit", str(path), *pairs, *flags]) == 2
        assert "tiergate batch: --metadata: metadata" in capsys.readouterr().err
    # Text that is not UTF-8 (bytes argv could not decode): a traceback from httpx before.
    assert main(["batch", "submit", str(path), "--metadata", "k=\udcff", *flags]) == 2
    assert "not UTF-8" in capsys.readouterr().err
    assert _file_ids(live_server, key) == []


def test_a_refused_batch_deletes_the_file_uploaded_for_it(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """submit_batch as `batch submit` calls it, past the CLI's own checks: the API's
    refusal is raised and the upload it made is gone."""
    key = _key(live_server)
    path = _input(tmp_path, 1)
    client = BatchClient(live_server.base_url, key, timeout_s=30)
    with client, pytest.raises(ApiError) as refused:
        submit_batch(client, path, "/v1/completions", {"k": "v" * 513})
    assert refused.value.payload["error"]["param"] == "metadata.k"
    assert (refused.value.note or "").startswith("deleted file-")
    assert _file_ids(live_server, key) == []


@pytest.mark.parametrize("argv", [("batch",), ("batch", "submit"), ("batch", "status")])
def test_help_gives_the_exit_statuses(capsys, argv) -> None:
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "exit status: 0 done, 1 the API refused the request or the batch did not" in text
    assert "2 bad usage or an unreachable server" in text
