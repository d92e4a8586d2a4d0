"""Checks on a batch request and on its input file, before any line runs.

`parse_create_request` turns `POST /v1/batches` into a typed request (400 on anything
malformed). `validate_input` reads a whole input file and returns either its lines or
the per-line errors that fail the batch: a line that is not a JSON object of the right
shape, a `url` other than the batch's endpoint, a duplicate `custom_id`, too many lines
or too many bytes. Whether each body is a valid request is decided later, line by line,
exactly as the live endpoint decides it; those errors go to the error file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway import json_body
from gateway.batch_metadata import metadata_problem
from gateway.errors import InvalidRequestError
from gateway.openai.schemas import parse_json_object
from gateway.settings import DEFAULT_MAX_BODY_BYTES

ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
COMPLETION_WINDOWS_S = {"24h": 86_400}
MAX_INPUT_LINES = 50_000
MAX_INPUT_BYTES = 200 * 1024 * 1024
MAX_CUSTOM_ID_CHARS = 512
# A broken file can hold 50,000 bad lines; the batch object reports the first ones.
MAX_REPORTED_ERRORS = 1_000
# What a line may hold besides its body: the envelope's keys, a custom_id of
# MAX_CUSTOM_ID_CHARS (each escaped as up to 12 bytes), whitespace.
LINE_ENVELOPE_BYTES = 8 * 1024


@dataclass(frozen=True)
class CreateBatchRequest:
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None


@dataclass(frozen=True)
class InputLine:
    line_index: int  # 0-based position among the file's non-blank lines
    custom_id: str
    body_json: str  # the request body, re-serialised


@dataclass(frozen=True)
class LineError:
    """Why a batch failed validation; `line` is 1-based, None for the whole file."""

    code: str
    message: str
    line: int | None = None
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "param": self.param, "line": self.line}


@dataclass(frozen=True)
class ValidationLimits:
    max_lines: int = MAX_INPUT_LINES
    max_bytes: int = MAX_INPUT_BYTES
    # The live endpoint's body limit (max_body_bytes): a line's body may be no larger
    # than a request's. Parsing a line costs many times its size in memory (a 20 MB line
    # of empty chat messages took 2.3 GB), and an input file may be 200 MiB in one line,
    # so an unbounded line could take the gateway down before any limit applied.
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


def parse_create_request(body: bytes) -> CreateBatchRequest:
    data = parse_json_object(body)
    input_file_id = data.get("input_file_id")
    if not isinstance(input_file_id, str) or not input_file_id:
        raise InvalidRequestError(
            "Missing required parameter: 'input_file_id'.", param="input_file_id"
        )
    endpoint = data.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in ENDPOINTS:
        raise InvalidRequestError(
            f"endpoint must be one of {', '.join(ENDPOINTS)}.", param="endpoint"
        )
    window = data.get("completion_window")
    if not isinstance(window, str) or window not in COMPLETION_WINDOWS_S:
        raise InvalidRequestError(
            f"completion_window must be one of {', '.join(COMPLETION_WINDOWS_S)}.",
            param="completion_window",
        )
    if data.get("output_expires_after") is not None:
        # Silently kept forever, an output file would outlive what the client asked for.
        raise InvalidRequestError(
            "output_expires_after is not supported: output and error files are kept until deleted.",
            param="output_expires_after",
        )
    return CreateBatchRequest(input_file_id, endpoint, window, _metadata(data.get("metadata")))


def _metadata(raw: Any) -> dict[str, str] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidRequestError("metadata must be an object.", param="metadata")
    problem = metadata_problem(raw)
    if problem is not None:
        message, param = problem
        raise InvalidRequestError(message, param=param)
    return dict(raw)


def validate_input(
    content: bytes, endpoint: str, limits: ValidationLimits
) -> tuple[list[InputLine], list[LineError]]:
    """The file's lines, or (with no lines) the errors that fail the batch."""
    if len(content) > limits.max_bytes:
        return [], [
            LineError(
                "file_too_large",
                f"The input file is {len(content)} bytes; a batch takes at most "
                f"{limits.max_bytes}.",
            )
        ]
    # Editors that save "UTF-8 with BOM" put one before the first line; it is no text.
    content = content.removeprefix(b"\xef\xbb\xbf")
    raw_lines = [line for line in content.split(b"\n") if line.strip()]
    if not raw_lines:
        return [], [LineError("empty_file", "The input file holds no requests.")]
    if len(raw_lines) > limits.max_lines:
        return [], [
            LineError(
                "too_many_requests",
                f"The input file holds {len(raw_lines)} requests; a batch takes at most "
                f"{limits.max_lines}.",
            )
        ]
    lines: list[InputLine] = []
    errors: list[LineError] = []
    seen: set[str] = set()
    # Line numbers count every physical line (blank ones too), as an editor shows them.
    numbers = [i + 1 for i, line in enumerate(content.split(b"\n")) if line.strip()]
    max_line_bytes = limits.max_body_bytes + LINE_ENVELOPE_BYTES
    for index, (number, raw) in enumerate(zip(numbers, raw_lines, strict=True)):
        if len(raw) > max_line_bytes:  # checked before the line is parsed
            errors.append(
                LineError(
                    "line_too_large",
                    f"Line {number} is {len(raw)} bytes; a line's body may be at most "
                    f"{limits.max_body_bytes} bytes, as a request's.",
                    number,
                    "body",
                )
            )
            continue
        try:
            line = _parse_line(raw, endpoint, number, index, limits.max_body_bytes)
        except _LineInvalid as exc:
            errors.append(exc.error)
            continue
        if line.custom_id in seen:
            errors.append(
                LineError(
                    "duplicate_custom_id",
                    f"custom_id {line.custom_id!r} appears more than once.",
                    number,
                    "custom_id",
                )
            )
            continue
        seen.add(line.custom_id)
        lines.append(line)
    if errors:
        return [], errors[:MAX_REPORTED_ERRORS]
    return lines, []


class _LineInvalid(Exception):
    def __init__(self, error: LineError) -> None:
        super().__init__(error.message)
        self.error = error


def _parse_line(
    raw: bytes, endpoint: str, number: int, index: int, max_body_bytes: int
) -> InputLine:
    def invalid(code: str, message: str, param: str | None = None) -> _LineInvalid:
        return _LineInvalid(LineError(code, message, number, param))

    try:
        data = json_body.loads(raw.decode("utf-8"))
    except ValueError as exc:  # JsonBodyError, UnicodeDecodeError
        raise invalid("invalid_json_line", f"Line {number} is not valid JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise invalid("invalid_json_line", f"Line {number} is not a JSON object.")
    custom_id = data.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise invalid("invalid_request", "custom_id must be a non-empty string.", "custom_id")
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        raise invalid(
            "invalid_request",
            f"custom_id is at most {MAX_CUSTOM_ID_CHARS} characters.",
            "custom_id",
        )
    if "\x00" in custom_id:
        # PostgreSQL text cannot hold NUL: the line could never be stored.
        raise invalid("invalid_request", "custom_id may not contain NUL characters.", "custom_id")
    if data.get("method") != "POST":
        raise invalid("invalid_request", 'method must be "POST".', "method")
    url = data.get("url")
    if url != endpoint:
        raise invalid(
            "mismatched_url",
            f"url {url!r} differs from the batch's endpoint {endpoint!r}.",
            "url",
        )
    body = data.get("body")
    if not isinstance(body, dict):
        raise invalid("invalid_request", "body must be a JSON object.", "body")
    # The body as a request would carry it at its most compact: past the live limit in
    # this form, it is past it in any (the line's own check above leaves room for the
    # envelope around the body).
    num_bytes = len(json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode())
    if num_bytes > max_body_bytes:
        raise invalid(
            "line_too_large",
            f"Line {number}'s body is {num_bytes} bytes; a line's body may be at most "
            f"{max_body_bytes} bytes, as a request's.",
            "body",
        )
    return InputLine(index, custom_id, json.dumps(body, separators=(",", ":")))
