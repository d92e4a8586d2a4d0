"""/v1/files and /v1/batches: upload inputs, create, follow, list and cancel batches.

Every object belongs to the tenant whose key created it; another tenant's id is a 404,
never a 403. Creating or cancelling a batch only writes SQL and pokes this gateway's
driver; the driver (here or on another replica) does the work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.exc import IntegrityError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.auth import KeyAuthenticator, Principal
from gateway.batches.driver import BatchDriver
from gateway.batches.store import BatchStore, StorageQuotaError
from gateway.batches.validation import COMPLETION_WINDOWS_S, parse_create_request
from gateway.batches.views import batch_view, file_view
from gateway.db.batch_models import CANCELLED, CANCELLING
from gateway.errors import (
    AuthenticationError,
    ConflictError,
    InvalidRequestError,
    NotFoundError,
    PayloadTooLargeError,
)
from gateway.tiers import TierCatalog, TierPolicy

FILE_PURPOSES = ("batch",)
LISTED_PURPOSES = ("batch", "batch_output")  # uploaded, and written by a batch
BATCH_TIER = "batch"
DEFAULT_PAGE_SIZE = 20
MAX_PAGE_SIZE = 100
# Files list as OpenAI's do: up to 10,000 per page, all of them by default.
DEFAULT_FILE_PAGE_SIZE = 10_000
MAX_FILENAME_CHARS = 255


@dataclass(frozen=True)
class BatchDeps:
    auth: KeyAuthenticator
    tiers: TierCatalog
    store: BatchStore
    driver: BatchDriver
    max_file_bytes: int
    tenant_file_bytes: int = 8 * 1024**3  # a tenant's uploads in all
    model_name: str | None = None  # what the batch objects say runs them


class BatchRoutes:
    """The handlers; one instance per app."""

    def __init__(self, deps: BatchDeps) -> None:
        self.deps = deps

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/files", self.create_file, methods=["POST"]),
            Route("/v1/files", self.list_files, methods=["GET"]),
            Route("/v1/files/{file_id}", self.get_file, methods=["GET"]),
            Route("/v1/files/{file_id}", self.delete_file, methods=["DELETE"]),
            Route("/v1/files/{file_id}/content", self.file_content, methods=["GET"]),
            Route("/v1/batches", self.create_batch, methods=["POST"]),
            Route("/v1/batches", self.list_batches, methods=["GET"]),
            Route("/v1/batches/{batch_id}", self.get_batch, methods=["GET"]),
            Route("/v1/batches/{batch_id}/cancel", self.cancel_batch, methods=["POST"]),
        ]

    async def _principal(self, request: Request) -> Principal:
        return await self.deps.auth.authenticate(request.headers.get("authorization"))

    # Files ---------------------------------------------------------------------------

    async def create_file(self, request: Request) -> Response:
        principal = await self._principal(request)
        # Media types are case-insensitive (RFC 9110).
        if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            raise InvalidRequestError("Upload the file as multipart/form-data.", param="file")
        try:
            form = await request.form(max_files=1, max_fields=10)
        except HTTPException as exc:
            # A body that is not valid multipart (bad boundary, too many parts or files).
            raise InvalidRequestError(
                f"The upload is not valid: {exc.detail}", param="file"
            ) from exc
        try:
            purpose = form.get("purpose")
            upload = form.get("file")
            if purpose not in FILE_PURPOSES:
                raise InvalidRequestError(
                    f"purpose must be one of {', '.join(FILE_PURPOSES)}.", param="purpose"
                )
            if isinstance(upload, str):
                # A part without a filename (or with an empty one) arrives as a text field.
                raise InvalidRequestError(
                    "file must be sent as a file part, with a filename.", param="file"
                )
            if not isinstance(upload, UploadFile):
                raise InvalidRequestError("Missing required parameter: 'file'.", param="file")
            if "\x00" in (upload.filename or ""):
                raise InvalidRequestError(
                    "The file name may not contain NUL characters.", param="file"
                )
            content = await upload.read()
            filename = (upload.filename or "upload.jsonl")[:MAX_FILENAME_CHARS]
        finally:
            await form.close()
        if len(content) > self.deps.max_file_bytes:
            raise PayloadTooLargeError(
                f"The file is larger than the limit of {self.deps.max_file_bytes} bytes."
            )
        with _tenant_gone_as_401():
            try:
                row = await self.deps.store.create_file(
                    principal.tenant_id,
                    purpose=str(purpose),
                    filename=filename,
                    content=content,
                    quota_bytes=self.deps.tenant_file_bytes,
                )
            except StorageQuotaError as exc:
                raise InvalidRequestError(
                    f"Storing this file ({len(content)} bytes) would take this tenant's "
                    f"files past their limit of {exc.quota_bytes} bytes ({exc.used_bytes} "
                    "in use); delete files that are no longer needed.",
                    param="file",
                    code="storage_quota_exceeded",
                ) from None
        return JSONResponse(file_view(row))

    async def list_files(self, request: Request) -> Response:
        principal = await self._principal(request)
        params = request.query_params
        limit = _page_size(params.get("limit"), DEFAULT_FILE_PAGE_SIZE, DEFAULT_FILE_PAGE_SIZE)
        order = params.get("order") or "desc"
        if order not in ("asc", "desc"):
            raise InvalidRequestError("order must be asc or desc.", param="order")
        after = params.get("after") or None
        purpose = params.get("purpose") or None
        if purpose is not None and purpose not in LISTED_PURPOSES:
            raise InvalidRequestError(
                f"purpose must be one of {', '.join(LISTED_PURPOSES)}.", param="purpose"
            )
        page = None
        if after is None or "\x00" not in after:  # no row can hold a NUL
            page = await self.deps.store.list_files(
                principal.tenant_id,
                limit=limit,
                after=after,
                descending=order == "desc",
                purpose=purpose,
            )
        if page is None:
            raise InvalidRequestError(f"after names no file of yours: {after!r}.", param="after")
        rows, has_more = page
        return JSONResponse(_page([file_view(r) for r in rows], has_more))

    async def get_file(self, request: Request) -> Response:
        principal = await self._principal(request)
        return JSONResponse(file_view(await self._file(principal, request)))

    async def file_content(self, request: Request) -> Response:
        principal = await self._principal(request)
        file_id = _lookup_id(request.path_params["file_id"], _file_not_found)
        content = await self.deps.store.get_file_content(principal.tenant_id, file_id)
        if content is None:
            raise _file_not_found(file_id)
        return Response(content, media_type="application/octet-stream")

    async def delete_file(self, request: Request) -> Response:
        principal = await self._principal(request)
        file_id = _lookup_id(request.path_params["file_id"], _file_not_found)
        if not await self.deps.store.delete_file(principal.tenant_id, file_id):
            raise _file_not_found(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def _file(self, principal: Principal, request: Request):
        file_id = _lookup_id(request.path_params["file_id"], _file_not_found)
        row = await self.deps.store.get_file(principal.tenant_id, file_id)
        if row is None:
            raise _file_not_found(file_id)
        return row

    # Batches -------------------------------------------------------------------------

    async def create_batch(self, request: Request) -> Response:
        principal = await self._principal(request)
        parsed = parse_create_request(await request.body())
        _lookup_id(parsed.input_file_id, lambda i: _file_not_found(i, param="input_file_id"))
        input_file = await self.deps.store.get_file(principal.tenant_id, parsed.input_file_id)
        if input_file is None:
            raise _file_not_found(parsed.input_file_id, param="input_file_id")
        if input_file.purpose != "batch":
            raise InvalidRequestError(
                f"File {parsed.input_file_id} has purpose {input_file.purpose!r}, not 'batch'.",
                param="input_file_id",
            )
        tier = await self._batch_tier(principal)
        window_s = COMPLETION_WINDOWS_S[parsed.completion_window]
        if tier.completion_window_s is not None:
            window_s = min(window_s, tier.completion_window_s)
        with _tenant_gone_as_401():
            row = await self.deps.store.create_batch(
                principal.tenant_id,
                endpoint=parsed.endpoint,
                input_file_id=parsed.input_file_id,
                completion_window=parsed.completion_window,
                window_s=window_s,
                tier=tier.name,
                metadata=parsed.metadata,
            )
        self.deps.driver.notify(row.id)
        return JSONResponse(batch_view(row, None, self.deps.model_name))

    async def _batch_tier(self, principal: Principal) -> TierPolicy:
        """The batch tier, or the tenant's own tier if that one is lower still."""
        try:
            batch = await self.deps.tiers.get(BATCH_TIER)
        except NotFoundError:
            return principal.tier
        return principal.tier if principal.tier.rank > batch.rank else batch

    async def get_batch(self, request: Request) -> Response:
        principal = await self._principal(request)
        row = await self._batch(principal, request.path_params["batch_id"])
        counts = await self.deps.store.line_counts([row.id])
        return JSONResponse(batch_view(row, counts.get(row.id), self.deps.model_name))

    async def cancel_batch(self, request: Request) -> Response:
        principal = await self._principal(request)
        batch_id = request.path_params["batch_id"]
        row = await self._batch(principal, batch_id)
        if row.status not in (CANCELLING, CANCELLED):
            if not await self.deps.store.request_cancel(batch_id):
                row = await self._batch(principal, batch_id)
                raise ConflictError(
                    f"Cannot cancel a batch with status {row.status!r}.", code="batch_not_active"
                )
            self.deps.driver.notify(batch_id)
            row = await self._batch(principal, batch_id)
        counts = await self.deps.store.line_counts([row.id])
        return JSONResponse(batch_view(row, counts.get(row.id), self.deps.model_name))

    async def list_batches(self, request: Request) -> Response:
        principal = await self._principal(request)
        limit = _page_size(request.query_params.get("limit"))
        after = request.query_params.get("after") or None
        page = None
        if after is None or "\x00" not in after:  # no row can hold a NUL
            page = await self.deps.store.list_batches(principal.tenant_id, limit=limit, after=after)
        if page is None:
            # A mistake to report, not an empty page that reads as "no more batches".
            raise InvalidRequestError(f"after names no batch of yours: {after!r}.", param="after")
        rows, has_more = page
        counts = await self.deps.store.line_counts([r.id for r in rows])
        return JSONResponse(
            _page([batch_view(r, counts.get(r.id), self.deps.model_name) for r in rows], has_more)
        )

    async def _batch(self, principal: Principal, batch_id: str):
        _lookup_id(batch_id, _batch_not_found)
        row = await self.deps.store.get_batch(batch_id, principal.tenant_id)
        if row is None:
            raise _batch_not_found(batch_id)
        return row


def _batch_not_found(batch_id: str) -> NotFoundError:
    return NotFoundError(f"No batch with id {batch_id!r}.", code="batch_not_found")


def _lookup_id(value: str, not_found: Callable[[str], NotFoundError]) -> str:
    """`value`, or the not-found error at once for an id no row can have: PostgreSQL text
    cannot hold NUL, and the lookup would fail with a driver error instead of a 404."""
    if "\x00" in value:
        raise not_found(value)
    return value


def _file_not_found(file_id: str, *, param: str | None = None) -> NotFoundError:
    return NotFoundError(f"No file with id {file_id!r}.", param=param, code="file_not_found")


def _page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """A list response with OpenAI's cursor fields."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _page_size(
    raw: str | None, default: int = DEFAULT_PAGE_SIZE, maximum: int = MAX_PAGE_SIZE
) -> int:
    if raw is None:
        return default
    try:
        limit = int(raw)
    except ValueError:
        raise InvalidRequestError("limit must be an integer.", param="limit") from None
    if not 1 <= limit <= maximum:
        raise InvalidRequestError(f"limit must be in 1..{maximum}.", param="limit")
    return limit


@contextlib.contextmanager
def _tenant_gone_as_401() -> Iterator[None]:
    """A tenant deleted while its upload or batch was being stored fails the insert
    (its foreign key): the key that authenticated the request is gone with it, so the
    answer is the one the next request with that key gets, not a 500."""
    try:
        yield
    except IntegrityError as exc:
        raise AuthenticationError(
            "The API key's tenant was deleted while the request ran."
        ) from exc
