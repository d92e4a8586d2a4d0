"""`tiergate batch ...`: submit a JSONL file as a batch, follow it, fetch its results.

    tiergate batch submit FILE.jsonl [--endpoint /v1/chat/completions] [--wait]
    tiergate batch status BATCH_ID [--wait]
    tiergate batch results BATCH_ID -o out.jsonl [--errors errors.jsonl]
    tiergate batch cancel BATCH_ID

The server is `--url` (TIERGATE_URL, default http://127.0.0.1:8000), the tenant key
`--api-key` (TIERGATE_API_KEY, else OPENAI_API_KEY). `--wait` draws a progress bar
(completed/failed/total, the rate of lines run, ETA) until the batch ends; `status
--wait` takes up following a batch again (after a Ctrl-C of `submit --wait`). `submit`
checks --metadata before it uploads, and deletes its upload when the API refuses the
batch. Exit status: 0 on success, 1 for an API error or a batch that did not complete,
2 for bad usage or an unreachable server.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

import httpx

from gateway.admin_cli import (
    BadIdError,
    is_token_text,
    is_utf8,
    path_segment,
    positive_seconds,
)
from gateway.batch_metadata import metadata_problem
from gateway.cli_output import print_json, print_subcommand_help

DEFAULT_URL = "http://127.0.0.1:8000"
ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
TERMINAL_STATUSES = frozenset({"completed", "failed", "expired", "cancelled"})
BAR_WIDTH = 30


class ApiError(Exception):
    """The server answered with an error (printed as its JSON body)."""

    def __init__(self, payload: Any) -> None:
        super().__init__(json.dumps(payload))
        self.payload = payload
        self.note: str | None = None  # what the CLI did about it, printed after it


class BatchClient:
    """The few Files and Batches calls the CLI makes, over httpx."""

    def __init__(self, url: str, api_key: str, *, timeout_s: float) -> None:
        self._http = httpx.Client(
            base_url=url.rstrip("/") + "/v1",
            headers={"authorization": f"Bearer {api_key}"},
            timeout=timeout_s,
        )

    def __enter__(self) -> BatchClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._http.close()

    def _check(self, response: httpx.Response) -> httpx.Response:
        if not response.is_success:
            try:
                payload = response.json()
            except ValueError:
                payload = {"status": response.status_code, "body": response.text}
            raise ApiError(payload)
        return response

    def upload(self, path: Path) -> dict[str, Any]:
        with path.open("rb") as handle:
            files = {"file": (path.name, handle, "application/jsonl")}
            return self._check(
                self._http.post("/files", data={"purpose": "batch"}, files=files)
            ).json()

    def create(self, file_id: str, endpoint: str, metadata: dict[str, str]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "input_file_id": file_id,
            "endpoint": endpoint,
            "completion_window": "24h",
        }
        if metadata:
            body["metadata"] = metadata
        return self._check(self._http.post("/batches", json=body)).json()

    def delete_file(self, file_id: str) -> None:
        self._check(self._http.delete(f"/files/{path_segment(file_id)}"))

    def get(self, batch_id: str) -> dict[str, Any]:
        return self._check(self._http.get(f"/batches/{path_segment(batch_id)}")).json()

    def cancel(self, batch_id: str) -> dict[str, Any]:
        return self._check(self._http.post(f"/batches/{path_segment(batch_id)}/cancel")).json()

    def content(self, file_id: str) -> bytes:
        return self._check(self._http.get(f"/files/{path_segment(file_id)}/content")).content


# In every --help: argparse rewraps it, so it is one paragraph.
EXIT_STATUS_EPILOG = (
    "exit status: 0 done, 1 the API refused the request or the batch did not complete "
    "(--wait), 2 bad usage or an unreachable server"
)


def add_batch_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `batch` and its commands; each leaf sets `func(args) -> int`."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("TIERGATE_URL", DEFAULT_URL),
        help="tiergate server (TIERGATE_URL, default %(default)s)",
    )
    common.add_argument(
        "--api-key",
        default=os.environ.get("TIERGATE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="tenant API key (TIERGATE_API_KEY, else OPENAI_API_KEY)",
    )
    common.add_argument("--timeout-s", type=positive_seconds, default=60.0, help="HTTP timeout")

    batch = subparsers.add_parser(
        "batch", help="run JSONL files through the Batch API", epilog=EXIT_STATUS_EPILOG
    )
    actions = batch.add_subparsers(metavar="ACTION")
    batch.set_defaults(func=lambda _args: print_subcommand_help(batch))

    submit = actions.add_parser(
        "submit",
        help="upload a JSONL file and start a batch",
        parents=[common],
        epilog=EXIT_STATUS_EPILOG,
    )
    submit.add_argument("file", type=Path, help="JSONL input, one request per line")
    submit.add_argument("--endpoint", choices=ENDPOINTS, default=ENDPOINTS[0])
    submit.add_argument(
        "--metadata", action="append", default=[], metavar="KEY=VALUE", help="repeatable"
    )
    submit.add_argument("--wait", action="store_true", help="follow the batch until it ends")
    submit.add_argument(
        "--poll-s", type=positive_seconds, default=1.0, help="how often --wait polls"
    )
    submit.set_defaults(func=lambda args: _run(args, _submit))

    status = actions.add_parser(
        "status", help="show a batch", parents=[common], epilog=EXIT_STATUS_EPILOG
    )
    status.add_argument("batch_id")
    status.add_argument(
        "--wait", action="store_true", help="follow the batch until it ends (as submit --wait)"
    )
    status.add_argument(
        "--poll-s", type=positive_seconds, default=1.0, help="how often --wait polls"
    )
    status.set_defaults(func=lambda args: _run(args, _status))

    results = actions.add_parser(
        "results", help="download a batch's results", parents=[common], epilog=EXIT_STATUS_EPILOG
    )
    results.add_argument("batch_id")
    results.add_argument("-o", "--output", type=Path, required=True, help="results JSONL")
    results.add_argument(
        "--errors", type=Path, help="error lines go here (default: after the results in -o)"
    )
    results.set_defaults(func=lambda args: _run(args, _results))

    cancel = actions.add_parser(
        "cancel", help="cancel a batch", parents=[common], epilog=EXIT_STATUS_EPILOG
    )
    cancel.add_argument("batch_id")
    cancel.set_defaults(func=lambda args: _run(args, lambda c, a: _print(c.cancel(a.batch_id))))
    return batch


def _run(args: argparse.Namespace, action: Callable[[BatchClient, argparse.Namespace], int]) -> int:
    if not args.api_key:
        print("tiergate batch: set --api-key or TIERGATE_API_KEY", file=sys.stderr)
        return 2
    if not is_token_text(args.api_key):
        print(
            "tiergate batch: API keys are printable ASCII with no spaces; this one is not",
            file=sys.stderr,
        )
        return 2
    try:
        # Checked before anything is sent (`submit` has no batch id).
        path_segment(getattr(args, "batch_id", "x"))
    except BadIdError as exc:
        print(f"tiergate batch: the batch id {exc}", file=sys.stderr)
        return 2
    try:
        with BatchClient(args.url, args.api_key, timeout_s=args.timeout_s) as client:
            return action(client, args)
    except BadIdError as exc:  # an id the server returned (a file id) that no path holds
        print(f"tiergate batch: an id {exc}", file=sys.stderr)
        return 1
    except ApiError as exc:
        print_json(exc.payload, sys.stderr)
        if exc.note:
            print(f"tiergate batch: {exc.note}", file=sys.stderr)
        return 1
    except httpx.InvalidURL as exc:  # not an HTTPError: raised before any connection
        print(f"tiergate batch: --url {args.url!r} is not a valid URL: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"tiergate batch: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2


def _print(payload: Any) -> int:
    print_json(payload)
    return 0


def _submit(client: BatchClient, args: argparse.Namespace) -> int:
    if args.file.is_dir():
        print(f"tiergate batch: {args.file} is a directory, not a JSONL file", file=sys.stderr)
        return 2
    if not args.file.exists():
        print(f"tiergate batch: no such file: {args.file}", file=sys.stderr)
        return 2
    if not args.file.is_file():  # /dev/null, a pipe: the upload sends a regular file
        print(f"tiergate batch: {args.file} is not a regular file", file=sys.stderr)
        return 2
    metadata = {}
    for pair in args.metadata:
        key, sep, value = pair.partition("=")
        if not sep:
            print(f"tiergate batch: --metadata wants KEY=VALUE, not {pair!r}", file=sys.stderr)
            return 2
        if not is_utf8(pair):  # bytes argv could not decode: no JSON body can hold them
            print(f"tiergate batch: --metadata {pair!r} is not UTF-8 text", file=sys.stderr)
            return 2
        metadata[key] = value
    problem = metadata_problem(metadata)
    if problem is not None:
        print(f"tiergate batch: --metadata: {problem[0]}", file=sys.stderr)
        return 2
    batch = submit_batch(client, args.file, args.endpoint, metadata)
    if not args.wait:
        return _print(batch)
    print(batch["id"], file=sys.stderr)
    return _follow_to_end(client, batch["id"], args.poll_s)


def _status(client: BatchClient, args: argparse.Namespace) -> int:
    if not args.wait:
        return _print(client.get(args.batch_id))
    return _follow_to_end(client, args.batch_id, args.poll_s)


def _follow_to_end(client: BatchClient, batch_id: str, poll_s: float) -> int:
    batch = follow(client, batch_id, poll_s=poll_s, out=sys.stderr)
    _print(batch)
    return 0 if batch["status"] == "completed" else 1


def submit_batch(
    client: BatchClient, path: Path, endpoint: str, metadata: dict[str, str]
) -> dict[str, Any]:
    """Upload `path` and create a batch of it; a batch the API refuses (ApiError) takes
    its upload with it, which would otherwise count against the tenant's file quota."""
    uploaded = client.upload(path)
    try:
        return client.create(uploaded["id"], endpoint, metadata)
    except ApiError as exc:
        exc.note = _delete_upload(client, uploaded["id"])
        raise


def _delete_upload(client: BatchClient, file_id: str) -> str:
    try:
        client.delete_file(file_id)
    except (ApiError, httpx.HTTPError) as exc:
        return (
            f"could not delete {file_id}, uploaded for the refused batch ({exc}); "
            f"delete it with DELETE /v1/files/{file_id}"
        )
    return f"deleted {file_id}, uploaded for the refused batch"


def follow(client: BatchClient, batch_id: str, *, poll_s: float, out: TextIO) -> dict[str, Any]:
    """Poll until the batch ends, drawing its progress; the final batch object."""
    started_s = time.monotonic()
    previous: dict[str, Any] | None = None  # the first poll: a resumed --wait's own rate
    num_ran = 0
    is_tty = out.isatty()
    last_line = ""
    while True:
        batch = client.get(batch_id)
        if previous is not None:
            num_ran += lines_ran_since(previous, batch)
        previous = batch
        counts = batch["request_counts"]
        line = progress_line(
            batch["status"],
            counts["completed"],
            counts["failed"],
            counts["total"],
            time.monotonic() - started_s,
            num_ran,
        )
        if is_tty:
            out.write("\r" + line.ljust(len(last_line)))
        elif line != last_line:
            out.write(line + "\n")
        out.flush()
        last_line = line
        if batch["status"] in TERMINAL_STATUSES:
            if is_tty:
                out.write("\n")
            return batch
        time.sleep(poll_s)


# Statuses in which the failed count also grows by lines closed without running: the
# cancelled or expired batch's pending lines, and those a cancel stopped in flight.
CLOSING_STATUSES = frozenset({"cancelling", "cancelled", "expired", "failed"})


def lines_ran_since(before: dict[str, Any], after: dict[str, Any]) -> int:
    """Lines that ran between two polls of one batch. Failed lines count only while the
    batch is not being closed; a line that really failed in the poll interval that ends
    it is left out, which costs the rate less than counting every closed line."""
    old, new = before["request_counts"], after["request_counts"]
    num_ran = new["completed"] - old["completed"]
    if after["status"] not in CLOSING_STATUSES:
        num_ran += new["failed"] - old["failed"]
    return num_ran


def progress_line(
    status: str, completed: int, failed: int, total: int, elapsed_s: float, num_new: int
) -> str:
    """`[#####-----] 12/40 done (1 failed) 3.2 req/s ETA 0:00:09 in_progress`."""
    done = completed + failed
    filled = int(BAR_WIDTH * done / total) if total else 0
    bar = "#" * filled + "-" * (BAR_WIDTH - filled)
    rate = num_new / elapsed_s if elapsed_s > 0 else 0.0
    eta = "--:--:--"
    if rate > 0 and total and status not in CLOSING_STATUSES:  # what is left will not run
        eta = _clock((total - done) / rate)
    return f"[{bar}] {done}/{total} done ({failed} failed) {rate:.1f} req/s ETA {eta} {status}"


def _clock(seconds: float) -> str:
    whole = round(seconds)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


def _results(client: BatchClient, args: argparse.Namespace) -> int:
    batch = client.get(args.batch_id)
    if batch["status"] not in TERMINAL_STATUSES:
        print(
            f"tiergate batch: {args.batch_id} is {batch['status']}; results come when it ends",
            file=sys.stderr,
        )
        return 1
    if batch["status"] == "failed":
        # Failed before any line ran (validation): the reasons are on the batch itself.
        print(f"tiergate batch: {args.batch_id} failed:", file=sys.stderr)
        for error in (batch.get("errors") or {}).get("data", []):
            where = f"line {error['line']}: " if error.get("line") else ""
            print(f"  {where}{error.get('code')}: {error.get('message')}", file=sys.stderr)
        return 1
    if args.errors is not None and args.errors.resolve() == args.output.resolve():
        # The second write would replace the first: leave --errors out to put both there.
        print(
            "tiergate batch: -o and --errors name the same file; leave --errors out to write "
            "the error lines after the results",
            file=sys.stderr,
        )
        return 2
    output = client.content(batch["output_file_id"]) if batch["output_file_id"] else b""
    errors = client.content(batch["error_file_id"]) if batch["error_file_id"] else b""
    try:
        if args.errors is not None:
            args.output.write_bytes(output)
            args.errors.write_bytes(errors)
        else:
            args.output.write_bytes(output + errors)
    except OSError as exc:
        print(f"tiergate batch: cannot write the results: {exc}", file=sys.stderr)
        return 1
    num_output = output.count(b"\n")
    num_errors = errors.count(b"\n")
    print(
        f"{num_output} results and {num_errors} errors of batch {args.batch_id} "
        f"({batch['status']})",
        file=sys.stderr,
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m gateway.batch_cli ...` (the same commands as `tiergate batch ...`)."""
    parser = argparse.ArgumentParser(prog="tiergate")
    add_batch_parser(parser.add_subparsers())
    args = parser.parse_args(["batch", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
