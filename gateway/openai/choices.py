"""The choices of one request: one job per choice, and their outputs merged.

A request asking for n > 1 choices runs as n jobs of the same tenant and tier, queued
one after another: the fair share charges each job for the work it does, SLO admission
judges the request by its first choice (whose first token is its TTFT), each choice
holds a concurrency slot, and the engine batches them like any other work.
Choice 0 keeps the request id as its job id, so a request with n = 1 is unchanged, and
choice j of a seeded prompt samples with seed + j (wrapped to 64 bits): the choices
differ, and each one is reproducible on its own.

A text completion with several prompts runs each one's n choices the same way: prompt
i's choice j is the response's choice i x n + j (OpenAI's numbering), with seed + j, so
each prompt's choices are what the same request with that prompt alone returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from engine.request import SamplingParams, TokenLogprob
from gateway.openai.logprobs import EchoedPrompt
from scheduler.job import Job

T = TypeVar("T")


def choice_job_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else f"{request_id}.{index}"


def request_of_job(job_id: str) -> str:
    """The request a job belongs to (choice_job_id's inverse)."""
    head, dot, tail = job_id.rpartition(".")
    return head if dot and tail.isdigit() else job_id


def choice_jobs(job: Job, n: int, *, first_index: int = 0) -> list[Job]:
    """The jobs of a prompt's n choices, the response's choices first_index onwards;
    `job` is the request's, its id the request id."""
    return [
        replace(
            job,
            job_id=choice_job_id(job.job_id, first_index + j),
            params=_choice_params(job.params, j),
        )
        if first_index + j
        else job
        for j in range(n)
    ]


@dataclass(frozen=True)
class RequestPlan:
    """What a validated request runs as: a job per (prompt, choice), in the response's
    choice order, and what each prompt adds to the response and its bill."""

    jobs: list[Job]
    n: int  # choices per prompt
    prompt_tokens: list[int]  # each prompt's
    echoed: list[EchoedPrompt] | None  # each prompt's, with `echo`

    @property
    def num_prompt_tokens(self) -> int:
        """Billed once per prompt, however many choices it has (as OpenAI counts)."""
        return sum(self.prompt_tokens)

    @property
    def num_reserved_tokens(self) -> int:
        """What the request may use at most: its prompts and every choice's max_tokens."""
        return self.num_prompt_tokens + sum(job.params.max_tokens for job in self.jobs)

    def billed_by_queue(self) -> RequestPlan:
        """The plan with each prompt's first choice carrying that prompt's tokens and the
        other choices none (Job.bill_prompt_tokens): what the queue bills should this
        gateway go before writing the request's usage record (a live request's; a Batch
        API line is run again instead)."""
        jobs = [
            replace(job, bill_prompt_tokens=0 if i % self.n else self.prompt_tokens[i // self.n])
            for i, job in enumerate(self.jobs)
        ]
        return replace(self, jobs=jobs)

    def echoed_for(self, index: int) -> EchoedPrompt | None:
        """What `echo` puts before choice `index` (None without it)."""
        return None if self.echoed is None else self.echoed[index // self.n]


def _choice_params(params: SamplingParams, index: int) -> SamplingParams:
    if params.seed is None:
        return params
    # Signed 64-bit, as the seed field takes: seed + index wraps at the end of the range.
    seed = (params.seed + index + 2**63) % 2**64 - 2**63
    return replace(params, seed=seed)


@dataclass
class CollectedChoice:
    """One choice of a non-streamed response, gathered output by output."""

    pieces: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None  # for echo with logprobs

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def choice_counts(choice_tokens: Sequence[int]) -> dict[str, Any]:
    """A request's output in its UsageRecord: the tokens of every choice, how many
    choices, and the longest one's tokens (None for one choice: completion_tokens)."""
    return {
        "completion_tokens": sum(choice_tokens),
        "num_choices": len(choice_tokens),
        "longest_choice_tokens": max(choice_tokens) if len(choice_tokens) > 1 else None,
    }


def first_queue_wait_ms(streams: Sequence[Any]) -> float | None:
    """A request's queue wait: its work began when its first choice left the queue."""
    waits = [s.queue_wait_ms for s in streams if s.queue_wait_ms is not None]
    return min(waits, default=None)


_DONE = object()


async def merge_choices(
    streams: Sequence[AsyncIterable[T]],
) -> AsyncGenerator[tuple[int, T], None]:
    """(choice index, output) from every stream, in the order the outputs arrive.

    The first error of any stream is raised at once; the caller cancels the other
    choices' jobs (their streams then end). Closing the iterator stops its readers.
    """
    if len(streams) == 1:  # no reader task: the common case costs what it did
        async for output in streams[0]:
            yield 0, output
        return
    arrived: asyncio.Queue[tuple[int, Any, BaseException | object | None]] = asyncio.Queue()

    async def read(index: int, stream: AsyncIterable[T]) -> None:
        try:
            async for output in stream:
                arrived.put_nowait((index, output, None))
        except Exception as exc:
            arrived.put_nowait((index, None, exc))
        else:
            arrived.put_nowait((index, None, _DONE))

    readers = [asyncio.create_task(read(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, output, end = await arrived.get()
            if end is _DONE:
                open_streams -= 1
            elif isinstance(end, BaseException):
                raise end
            else:
                yield index, output
    finally:
        for reader in readers:
            reader.cancel()
