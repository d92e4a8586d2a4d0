"""Runs one step plan on the model: builds the flattened batch, runs it, samples.

The runner owns the KV cache tensors and nothing else of the engine's state: the step
scheduler decides what runs and the block manager which slots it uses; the runner turns
that into tensors. Per-token Python work is kept to the decode tokens' few integers;
prefill chunks are converted with tensor ops.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Sequence
from typing import Protocol

import torch

from engine.errors import ModelLoadError
from engine.models import AttentionMetadata, LoadedModel, ModelArch
from engine.request import Request
from engine.sampling import OutputCounts, prompt_mask, sample, token_logprobs

_NUM_DECODE_GROUPS = 4
_MIN_DECODES_TO_GROUP = 8
# Prompt positions whose logits are made at once for prompt log-probabilities. Each
# block holds about three rows x vocabulary float32 tensors at a time (the logits, the
# rows scored, their log-softmax): 128 x 128k x 4 bytes x 3 = 192 MiB at most.
_PROMPT_LOGPROB_ROWS = 128
_CPU_DEFAULT_KV_CACHE_BYTES = 512 * 2**20
# Left free on a GPU for activations and the allocator's slack when sizing the cache.
_CUDA_ACTIVATION_RESERVE_BYTES = 1 * 2**30


class Chunk(Protocol):
    """What the runner reads of a scheduled chunk (engine.step_scheduler.ScheduledChunk)."""

    request: Request
    start: int
    num_tokens: int
    produces_token: bool


def kv_cache_budget_bytes(
    device: torch.device, requested_bytes: int | None, utilization: float, needed_bytes: int
) -> int:
    """The KV cache budget: as asked, else free GPU memory x utilisation, else (CPU)
    what the configured batch can use, capped so a laptop is not swamped."""
    if requested_bytes is not None:
        return requested_bytes
    if device.type == "cuda":
        free_bytes, _ = torch.cuda.mem_get_info(device)
        return max(0, int(free_bytes * utilization) - _CUDA_ACTIVATION_RESERVE_BYTES)
    return min(needed_bytes, _CPU_DEFAULT_KV_CACHE_BYTES)


def num_kv_blocks(arch: ModelArch, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many KV blocks fit in `budget_bytes`."""
    bytes_per_block = arch.kv_bytes_per_token(dtype.itemsize) * block_size
    return budget_bytes // bytes_per_block


class ModelRunner:
    """Executes step plans on one device with a paged KV cache of `num_blocks` blocks.

    `eos_token_ids` are the model's end-of-sequence ids, which a request's min_tokens
    keeps from being sampled (unless it ignores eos) until it has made that many.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        block_size: int,
        num_blocks: int,
        seed: int = 0,
        eos_token_ids: Collection[int] = (),
    ) -> None:
        if num_blocks < 1:
            raise ModelLoadError("the KV cache budget is too small for even one block")
        self.model = loaded.model
        self.arch = loaded.arch
        self.device = loaded.device
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_blocks, block_size, self.arch.num_kv_heads, self.arch.head_dim)
        # Zeroed, not empty: padding slots are masked, but 0 * NaN would still be NaN.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=loaded.dtype, device=self.device),
                torch.zeros(shape, dtype=loaded.dtype, device=self.device),
            )
            for _ in range(self.arch.num_layers)
        ]
        self.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.eos_token_ids = frozenset(eos_token_ids)

    @torch.inference_mode()
    def execute(self, chunks: Sequence[Chunk]) -> list[int | None]:
        """Run one step; returns the sampled token of each chunk (None if it makes none)."""
        if not chunks:
            return []
        # Sorted by context length so that similar lengths share an attention call.
        decodes = sorted((c for c in chunks if c.num_tokens == 1), key=lambda c: c.start)
        prefills = [c for c in chunks if c.num_tokens != 1]
        input_ids, positions, meta, logit_rows = self._prepare(decodes, prefills)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        if any(c.request.needs_prompt_logprobs for c in chunks):
            self._prompt_logprobs(decodes, prefills, hidden)
        producing = [c for c in decodes + prefills if c.produces_token]
        if not producing:
            return [None] * len(chunks)
        rows = torch.tensor(logit_rows, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))
        tokens = sample(
            logits,
            [c.request.params for c in producing],
            [c.request.num_output_tokens for c in producing],
            self.generator,
            self._output_counts(producing),
            self._prompt_masks(producing),
            self.eos_token_ids,
        )
        num_top = [c.request.params.logprobs for c in producing]
        if any(n is not None for n in num_top):
            logprobs = token_logprobs(logits, tokens, num_top)
            for c, logprob in zip(producing, logprobs, strict=True):
                c.request.new_logprob = logprob
        by_chunk = {id(c): t for c, t in zip(producing, tokens, strict=True)}
        return [by_chunk.get(id(c)) for c in chunks]

    def _prompt_logprobs(
        self, decodes: list[Chunk], prefills: list[Chunk], hidden: torch.Tensor
    ) -> None:
        """Append to each asking request the log-probabilities of the prompt tokens its
        chunk predicts (the hidden state at position p predicts token p + 1). A chunk
        of one token runs with the decodes; rows are laid out decodes first."""
        first_rows = {id(c): i for i, c in enumerate(decodes)}
        row = len(decodes)
        for c in prefills:
            first_rows[id(c)] = row
            row += c.num_tokens
        for c in decodes + prefills:
            request = c.request
            if not request.needs_prompt_logprobs:
                continue
            # From the first position not done yet (a recompute after preemption runs
            # positions again) to the one before the last prompt token.
            start = len(request.prompt_logprobs)
            end = min(c.start + c.num_tokens, request.num_prompt_tokens - 1)
            if not c.start <= start < end:
                continue
            for lo in range(start, end, _PROMPT_LOGPROB_ROWS):  # bounds the logits' memory
                hi = min(lo + _PROMPT_LOGPROB_ROWS, end)
                first = first_rows[id(c)] + lo - c.start
                logits = self.model.compute_logits(hidden[first : first + hi - lo])
                targets = request.prompt_token_ids[lo + 1 : hi + 1]
                num_top = [request.params.prompt_logprobs] * len(targets)
                request.prompt_logprobs.extend(token_logprobs(logits, targets, num_top))

    def _output_counts(self, producing: list[Chunk]) -> list[torch.Tensor | None] | None:
        """Each penalized request's output token counts (None for the others), kept on
        the request between steps."""
        if not any(c.request.params.has_penalties for c in producing):
            return None
        counts: list[torch.Tensor | None] = []
        for c in producing:
            request = c.request
            if not request.params.has_penalties:
                counts.append(None)
                continue
            if request.output_counts is None:
                request.output_counts = OutputCounts(self.arch.vocab_size, self.device)
            counts.append(request.output_counts.update(request.output_token_ids))
        return counts

    def _prompt_masks(self, producing: list[Chunk]) -> list[torch.Tensor | None] | None:
        """Each prompt's vocabulary mask where its request has a repetition penalty (None
        for the others), made on its first sampled token and kept on the request."""
        if all(c.request.params.repetition_penalty == 1.0 for c in producing):
            return None
        masks: list[torch.Tensor | None] = []
        for c in producing:
            request = c.request
            if request.params.repetition_penalty == 1.0:
                masks.append(None)
                continue
            if request.prompt_mask is None:
                request.prompt_mask = prompt_mask(
                    request.prompt_token_ids, self.arch.vocab_size, self.device
                )
            masks.append(request.prompt_mask)
        return masks

    def _prepare(self, decodes: list[Chunk], prefills: list[Chunk]):
        bs = self.block_size
        device = self.device
        # Decodes: one token each, a handful of Python ints per sequence.
        decode_ids = [_token_at(c.request, c.start) for c in decodes]
        decode_positions = [c.start for c in decodes]
        decode_slots = [
            c.request.block_ids[p // bs] * bs + p % bs
            for c, p in zip(decodes, decode_positions, strict=True)
        ]
        decode_lens = [p + 1 for p in decode_positions]
        logit_rows = [i for i, c in enumerate(decodes) if c.produces_token]
        # Prefill chunks: tensors per chunk.
        ids_parts = [torch.tensor(decode_ids, dtype=torch.long)]
        pos_parts = [torch.tensor(decode_positions, dtype=torch.long)]
        slot_parts = [torch.tensor(decode_slots, dtype=torch.long)]
        cu_seqlens = [0]
        prefill_lens = []
        offset = len(decodes)
        for c in prefills:
            req, start, n = c.request, c.start, c.num_tokens
            ids_parts.append(torch.tensor(_tokens(req, start, n), dtype=torch.long))
            pos = torch.arange(start, start + n, dtype=torch.long)
            table = torch.tensor(req.block_ids[: (start + n + bs - 1) // bs], dtype=torch.long)
            pos_parts.append(pos)
            slot_parts.append(table[pos // bs] * bs + pos % bs)
            cu_seqlens.append(cu_seqlens[-1] + n)
            prefill_lens.append(start + n)
            if c.produces_token:
                logit_rows.append(offset + cu_seqlens[-1] - 1)
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slot_parts).to(device),
            num_decode_tokens=len(decodes),
            decode_block_tables=_block_tables(decodes, decode_lens, bs).to(device),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32).to(device),
            prefill_block_tables=_block_tables(prefills, prefill_lens, bs).to(device),
            cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32).to(device),
            prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32).to(device),
            # GPU kernels take each row's own length; only the CPU references pad.
            decode_groups=_decode_groups(len(decodes)) if device.type == "cpu" else (),
        )
        input_ids = torch.cat(ids_parts).to(device)
        positions = torch.cat(pos_parts).to(device)
        return input_ids, positions, meta, logit_rows


def _decode_groups(num_decodes: int) -> tuple[tuple[int, int], ...]:
    """Equal-count row ranges over the length-sorted decodes: with uniform lengths, four
    groups cut the padded attention work by about a third for three extra calls."""
    if num_decodes < _MIN_DECODES_TO_GROUP:
        return ((0, num_decodes),)
    bounds = [num_decodes * i // _NUM_DECODE_GROUPS for i in range(_NUM_DECODE_GROUPS + 1)]
    return tuple(itertools.pairwise(bounds))


def _token_at(request: Request, index: int) -> int:
    num_prompt = len(request.prompt_token_ids)
    if index < num_prompt:
        return request.prompt_token_ids[index]
    return request.output_token_ids[index - num_prompt]


def _tokens(request: Request, start: int, num_tokens: int) -> list[int]:
    return request.token_range(start, start + num_tokens)


def _block_tables(chunks: Sequence[Chunk], context_lens: list[int], block_size: int):
    if not chunks:
        return torch.zeros((0, 1), dtype=torch.int32)
    counts = [(n + block_size - 1) // block_size for n in context_lens]
    width = max(counts)
    rows = [
        c.request.block_ids[:k] + [0] * (width - k) for c, k in zip(chunks, counts, strict=True)
    ]
    return torch.tensor(rows, dtype=torch.int32)
