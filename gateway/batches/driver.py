"""The batch driver: runs each active batch's lines, durably, one owner at a time.

Each gateway runs one driver. It takes the lease of active batches that have no live
owner (a conditional UPDATE), renews it while it drives them, and gives it up on
shutdown; when a gateway dies its leases lapse and another driver takes its batches over.
Progress is only what SQL holds: a line is done when its result row is committed, so a
resumed batch runs exactly the lines that have no result yet, and each line gets one
result whatever crashes in between.

Driving a batch: validate its input file into line rows, then keep up to
`max_in_flight` jobs (a line asking for n choices is n of them) submitted through the
dispatcher (the queue orders them behind
interactive work), store each result as it arrives, and end the batch with its output
and error files: completed, or cancelled / expired with the unfinished lines in the error
file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from engine.errors import EngineDeadError, RequestAbortedError
from gateway.auth import Principal
from gateway.batches.lines import LineRunner, error_outcome
from gateway.batches.store import BatchStore, PendingLine, result_line
from gateway.batches.validation import LineError, ValidationLimits, validate_input
from gateway.db.batch_models import (
    CANCELLED,
    CANCELLING,
    COMPLETED,
    EXPIRED,
    FAILED,
    FINALIZING,
    IN_PROGRESS,
    VALIDATING,
    BatchRow,
)
from gateway.db.models import utcnow
from gateway.errors import NotFoundError
from gateway.middleware import new_request_id
from gateway.tiers import TierCatalog, TierPolicy
from scheduler.backend import BackendUnavailableError, QueueFullError, UnknownTierError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DriverConfig:
    """How a driver paces itself. The lease must outlast a few heartbeats."""

    lease_s: float = 10.0  # a dead owner's batches are taken over after this
    poll_s: float = 1.0  # how often unowned batches are looked for
    # Batches this gateway drives at once, and at most per tenant across the fleet: one
    # tenant's many batches leave room for others' (the queue then shares the engines
    # between their lines by weight).
    max_batches: int = 32
    max_batches_per_tenant: int = 4
    # Jobs of one batch submitted at once (the tier may lower it): a line with n choices
    # counts n, so one batch of n=128 lines cannot fill the tier's queue alone.
    max_in_flight: int = 64
    # A queue that refuses a line (its tier's cap is reached, Redis is away) is asked
    # again after this long; the refused lines stay pending and go first then.
    refused_backoff_s: float = 0.5
    failure_backoff_s: float = 0.5  # the first pause after a failed drive of a batch
    # Failed drives in a row after which the batch is failed: an error that persists
    # (a bug, data the database refuses) would otherwise retry it until its window ends.
    max_drive_failures: int = 5
    # ...and over at least this long: a database away for a while fails every drive,
    # and the batches it holds are not at fault.
    min_failing_s: float = 60.0
    limits: ValidationLimits = field(default_factory=ValidationLimits)

    @property
    def heartbeat_s(self) -> float:
        return min(self.lease_s / 4, 1.0)


class BatchDriver:
    """Claims, drives and finishes batches; one per gateway process."""

    def __init__(
        self,
        store: BatchStore,
        runner: LineRunner,
        tiers: TierCatalog,
        config: DriverConfig | None = None,
        *,
        on_unknown_tier: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`on_unknown_tier` copies the tier table from SQL into the queue again (the
        queue lost it: Redis restarted empty), as admission does for a request."""
        self._store = store
        self._runner = runner
        self._tiers = tiers
        self._on_unknown_tier = on_unknown_tier
        self._tiers_restored_s = -math.inf  # monotonic time of the last restore_tiers
        self.config = config or DriverConfig()
        # Host and pid say which process drives a batch (an operator reads it in SQL).
        self.owner_id = f"{socket.gethostname()[:32]}:{os.getpid()}:{secrets.token_hex(6)}"
        self._driving: dict[str, asyncio.Task[None]] = {}
        self._pokes: dict[str, asyncio.Event] = {}
        # batch id -> (failed drives in a row, monotonic time of the first of them)
        self._failures: dict[str, tuple[int, float]] = {}
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None

    async def restore_tiers(self) -> None:
        """Copy the tier table into the queue again, at most once a second however many
        lines met its absence; a failure is logged (the lines stay pending and retry)."""
        now = time.monotonic()
        if self._on_unknown_tier is None or now - self._tiers_restored_s < 1.0:
            return
        self._tiers_restored_s = now
        try:
            await self._on_unknown_tier()
        except Exception as exc:
            log.warning("could not copy the tier table into the queue (%s)", type(exc).__name__)

    @property
    def batch_ids(self) -> list[str]:
        """The batches this driver holds the lease of right now."""
        return list(self._driving)

    def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="batch-driver")

    def notify(self, batch_id: str | None = None) -> None:
        """A batch was created or cancelled here: look at it now, not at the next poll."""
        self._wake.set()
        if batch_id is not None and batch_id in self._pokes:
            self._pokes[batch_id].set()

    async def aclose(self) -> None:
        """Stop driving: abort in-flight lines (they stay pending) and release the leases."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        tasks = list(self._driving.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            num_free = self.config.max_batches - len(self._driving)
            if num_free > 0:
                try:
                    claimed = await self._store.claim(
                        self.owner_id,
                        self.config.lease_s,
                        limit=num_free,
                        per_tenant=self.config.max_batches_per_tenant,
                    )
                except Exception:
                    log.exception("claiming batches failed; retrying")
                    claimed = []
                for batch_id in claimed:
                    self._pokes[batch_id] = asyncio.Event()
                    self._driving[batch_id] = asyncio.create_task(
                        self._drive(batch_id), name=f"batch-{batch_id}"
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_s)

    async def _drive(self, batch_id: str) -> None:
        run = _BatchRun(self, batch_id)
        is_lost = False
        pause_s = 0.0
        try:
            is_lost = await run.drive()
            self._failures.pop(batch_id, None)
        except asyncio.CancelledError:
            raise
        except Exception:
            # The lease is released below; this or another gateway picks it up again,
            # after a pause that doubles with each failure in a row (up to the lease), so
            # a batch that keeps failing does not spin.
            num_failures, first_s = self._failures.get(batch_id, (0, time.monotonic()))
            num_failures += 1
            self._failures[batch_id] = (num_failures, first_s)
            log.exception("driving batch %s failed (%d in a row)", batch_id, num_failures)
            pause_s = min(
                self.config.failure_backoff_s * 2 ** (num_failures - 1), self.config.lease_s
            )
            is_persistent = (
                num_failures >= self.config.max_drive_failures
                and time.monotonic() - first_s >= self.config.min_failing_s
            )
            if is_persistent and await run.give_up():
                self._failures.pop(batch_id, None)
                pause_s = 0.0  # ended: no one is to retry it
        finally:
            try:
                await run.stop_lines()
                if pause_s:
                    await asyncio.sleep(pause_s)  # still ours meanwhile: nobody claims it
            finally:  # released even if a shutdown cancels the pause
                if not is_lost:
                    with contextlib.suppress(Exception):
                        await self._store.release(batch_id, self.owner_id)
                self._driving.pop(batch_id, None)
                self._pokes.pop(batch_id, None)
                self._wake.set()


class _BatchRun:
    """One lease's worth of driving one batch."""

    def __init__(self, driver: BatchDriver, batch_id: str) -> None:
        self.driver = driver
        self.store = driver._store
        self.batch_id = batch_id
        self.owner = driver.owner_id
        self.config = driver.config
        # Request id -> its line's task and jobs (a line with n choices runs n).
        self.in_flight: dict[str, tuple[asyncio.Task[None], int]] = {}
        self.cursor = -1  # highest line index submitted in this pass
        # Lines the queue refused (still pending, not in flight), retried before new ones.
        self.refused: list[PendingLine] = []
        self.refused_until_s = 0.0  # monotonic; no line is submitted before it
        self.is_engine_dead = False
        self.principal: Principal | None = None
        self.tier: TierPolicy | None = None
        self.loaded_s = 0.0  # monotonic: when principal and tier were read
        self.is_suspended = False

    async def drive(self) -> bool:
        """Drive until the batch ends or the lease is lost; True if it was lost."""
        poke = self.driver._pokes.get(self.batch_id) or asyncio.Event()
        while True:
            batch = await self.store.renew(self.batch_id, self.owner, self.config.lease_s)
            if batch is None:
                log.warning("lost the lease of batch %s", self.batch_id)
                return True
            poke.clear()
            if batch.status == VALIDATING:
                await self._validate(batch)
            elif batch.status == CANCELLING:
                await self.stop_lines()
                await self._finish(CANCELLED, "batch_cancelled")
                return False
            elif batch.status == FINALIZING:
                await self._finish(COMPLETED, None)
                return False
            elif batch.status == IN_PROGRESS:
                if utcnow() >= batch.expires_at:
                    await self.stop_lines()
                    await self._finish(EXPIRED, "batch_expired")
                    return False
                if self.is_engine_dead:
                    return False  # released: a gateway with a live engine takes it over
                if self.is_suspended and not self.in_flight:
                    # Released: a paused batch would only hold a slot. The claim passes
                    # it over until its tenant is active again (or its window ends).
                    return False
                if not await self._advance(batch):
                    await self.store.begin_finalizing(self.batch_id, self.owner)
                    continue
                await self._wait(poke)
            else:
                return False  # ended by someone else

    async def _validate(self, batch: BatchRow) -> None:
        content = await self.store.get_file_content(batch.tenant_id, batch.input_file_id)
        if content is None:
            lines, errors = [], [LineError("file_not_found", "The input file no longer exists.")]
        else:
            lines, errors = await asyncio.to_thread(
                validate_input, content, batch.endpoint, self.config.limits
            )
        await self.store.store_validation(self.batch_id, self.owner, lines, errors)

    async def _advance(self, batch: BatchRow) -> bool:
        """Submit lines up to the window; False when none is pending or running."""
        # Read again every heartbeat: a suspended tenant's batch pauses (its lines stay
        # pending until it is active again or the batch expires), and changed limits,
        # weight or tier apply to the lines submitted from then on.
        if self.principal is None or time.monotonic() - self.loaded_s >= self.config.heartbeat_s:
            await self._load_principal(batch)
        if self.is_suspended:
            # Paused now, not once the window in flight has run: those lines stop,
            # unbilled, and run again once the tenant is active.
            if self.in_flight:
                await self.stop_lines()
            return True
        if time.monotonic() < self.refused_until_s:
            return True  # the queue is full: leave the lines pending a little longer
        while self.refused and self._fits(self.refused[0]):
            self._submit(batch, self.refused.pop(0))
        room = self._window() - self.num_jobs_in_flight
        if room > 0 and not self.refused:
            lines = await self.store.pending_lines(
                self.batch_id, after_index=self.cursor, limit=room
            )
            for line in lines:
                if not self._fits(line):
                    break  # the rest stay pending, read again once jobs finish
                self._submit(batch, line)
            if not lines and not self.in_flight and not self.refused:
                if await self.store.num_pending(self.batch_id) == 0:
                    return False
                # Lines skipped in this pass (an aborted run) are still pending: go again.
                self.cursor = -1
                await asyncio.sleep(self.config.heartbeat_s)
        return True

    @property
    def num_jobs_in_flight(self) -> int:
        return sum(num_jobs for _, num_jobs in self.in_flight.values())

    def _window(self) -> int:
        """Jobs in flight at most: the driver's cap, within the tenant's concurrency
        limit (its own, else its tier's) and the batch tier's."""
        limits = [self.config.max_in_flight]
        if self.principal is not None and self.principal.max_concurrency:
            limits.append(self.principal.max_concurrency)
        if self.tier is not None and self.tier.max_concurrency:
            limits.append(self.tier.max_concurrency)
        return max(1, min(limits))

    def _fits(self, line: PendingLine) -> bool:
        """Whether the line's jobs fit in the window (any line does when none runs)."""
        if not self.in_flight:
            return True
        return self.num_jobs_in_flight + line.num_choices <= self._window()

    def _submit(self, batch: BatchRow, line: PendingLine) -> None:
        request_id = new_request_id()
        self.cursor = max(self.cursor, line.line_index)
        task = asyncio.create_task(
            self._run_line(batch, line, request_id), name=f"batch-line-{request_id}"
        )
        self.in_flight[request_id] = (task, line.num_choices)
        task.add_done_callback(lambda _t: self.in_flight.pop(request_id, None))

    async def _run_line(self, batch: BatchRow, line: PendingLine, request_id: str) -> None:
        if self.principal is None or self.tier is None:
            raise RuntimeError("a line was submitted before the batch's tenant was loaded")
        try:
            outcome = await self.driver._runner.run(
                request_id=request_id,
                principal=self.principal,
                tier=self.tier,
                endpoint=batch.endpoint,
                body_json=line.body_json,
                deadline_s=batch.expires_at.timestamp(),
            )
        except RequestAbortedError:
            return  # cancelled by this driver; the line stays pending
        except UnknownTierError as exc:
            # The batch's tier left the queue's table (deleted, or Redis restarted
            # empty): not the line's fault. It stays pending; the next pass reloads the
            # tenant and tier (the tenant's own tier if the batch's is gone). The table
            # goes back into the queue too: with no request of any other kind to do it,
            # a batch-only fleet retried against the empty table until one came along.
            log.warning("batch %s: %s; reloading its tier", self.batch_id, exc)
            self.principal = None
            self.tier = None
            self.refused.append(line)
            self.refused_until_s = time.monotonic() + self.config.refused_backoff_s
            await self.driver.restore_tiers()
            return
        except (QueueFullError, BackendUnavailableError) as exc:
            # Not the line's fault: it stays pending and is offered again after a pause,
            # so a full batch tier slows the batch down instead of failing its lines.
            log.debug(
                "batch %s line %d refused by the queue: %s", self.batch_id, line.line_index, exc
            )
            if isinstance(exc, BackendUnavailableError):
                # The job may be queued or running already (the queue went away after
                # it took it): the line runs again under a new id, so this one must not
                # run on for nobody. The job client retries it once the queue is back.
                with contextlib.suppress(Exception):
                    await self.driver._runner.cancel(request_id)
            self.refused.append(line)
            self.refused_until_s = time.monotonic() + self.config.refused_backoff_s
            return
        except EngineDeadError:
            self.is_engine_dead = True
            return
        except Exception as exc:
            # A bug, neither the line's fault nor the queue's: retried, it would fail
            # again at every pass. The line fails with a 500 (error_outcome logs it).
            outcome = error_outcome(request_id, exc)
        stored = await self.store.finish_line(
            self.batch_id,
            line.line_index,
            is_success=outcome.is_success,
            result_json=result_line(line.custom_id, response=outcome.response()),
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            usage=outcome.usage,
        )
        if stored and outcome.usage is not None:
            self.driver._runner.finished(outcome.usage)

    async def _wait(self, poke: asyncio.Event) -> None:
        """Until a line finishes, the batch is poked, or the next heartbeat is due."""
        deadline = time.monotonic() + self.config.heartbeat_s
        while time.monotonic() < deadline and not poke.is_set():
            waiters = {task for task, _ in self.in_flight.values()}
            poke_task = asyncio.ensure_future(poke.wait())
            try:
                await asyncio.wait(
                    {*waiters, poke_task},
                    timeout=deadline - time.monotonic(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                poke_task.cancel()
            # Refill the window as soon as lines finish, without waiting for a heartbeat.
            if self.num_jobs_in_flight < self._window() and self.principal is not None:
                batch = await self.store.get_batch(self.batch_id)
                if batch is None or batch.status != IN_PROGRESS:
                    return
                if not await self._advance(batch):
                    return

    async def _load_principal(self, batch: BatchRow) -> None:
        tenant = await self.store.get_tenant(batch.tenant_id)
        if tenant is None:
            raise RuntimeError(f"the tenant of batch {batch.id} no longer exists")
        own_tier = await self.driver._tiers.get(tenant.tier)
        try:
            tier = await self.driver._tiers.get(batch.tier)
        except NotFoundError:
            tier = own_tier  # the batch tier was deleted since: run at the tenant's own
        self.tier = tier
        self.loaded_s = time.monotonic()
        self.is_suspended = tenant.status != "active"
        self.principal = Principal(
            tenant_id=tenant.id,
            tenant_name=tenant.name,
            key_id="",
            tier=own_tier,
            weight=tenant.weight,
            rpm=tenant.rpm if tenant.rpm is not None else own_tier.rpm,
            tpm=tenant.tpm if tenant.tpm is not None else own_tier.tpm,
            max_concurrency=(
                tenant.max_concurrency
                if tenant.max_concurrency is not None
                else own_tier.max_concurrency
            ),
        )

    async def stop_lines(self) -> None:
        """Abort every in-flight line and wait for it; aborted lines stay pending."""
        entries = list(self.in_flight.items())
        for request_id, _ in entries:
            with contextlib.suppress(Exception):
                await self.driver._runner.cancel(request_id)
        tasks = [task for _, (task, _) in entries]
        if tasks:
            _done, stuck = await asyncio.wait(tasks, timeout=5.0)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def give_up(self) -> bool:
        """Fail the batch after repeated failed drives; False if that failed too."""
        try:
            batch = await self.store.get_batch(self.batch_id)
            if batch is None or batch.owner != self.owner:
                return False
            message = "The batch could not be processed; see the server log."
            if batch.status == VALIDATING:
                error = LineError("batch_failed", message)
                return await self.store.store_validation(self.batch_id, self.owner, [], [error])
            await self.stop_lines()
            return await self.store.finish_batch(
                self.batch_id, self.owner, final_status=FAILED, close_code="batch_failed"
            )
        except Exception:
            log.exception("failing batch %s failed too", self.batch_id)
            return False

    async def _finish(self, final_status: str, close_code: str | None) -> None:
        await self.store.finish_batch(
            self.batch_id, self.owner, final_status=final_status, close_code=close_code
        )
