"""Paged KV cache bookkeeping: which physical blocks hold which request's tokens.

The cache is `num_blocks` blocks of `block_size` token slots. A request owns the list
`request.block_ids`; token i of `request.all_token_ids` lives in slot
`i % block_size` of block `block_ids[i // block_size]`.

Prefix caching: once a block is full of computed tokens it is published under a hash
that chains over every token before it, so another request (or the same one, resumed
after a preemption) with the same prefix reuses it instead of recomputing. Blocks are
reference counted; a published block whose last user leaves goes to an LRU list and
stays reusable until a fresh allocation needs its slot.

Pure Python: the policy half of the engine imports without torch.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from engine.request import Request, RequestStatus

# Parent hash of a request's first block.
_ROOT_HASH = 0


@dataclass(slots=True)  # one per KV block: a fleet simulation holds millions
class _Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    # Kept for published blocks so that a hash collision can never hand out wrong KV.
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters of the prefix cache since the block manager was built."""

    num_query_tokens: int  # prompt (+ output, on resume) tokens looked up at admission
    num_hit_tokens: int  # of those, tokens whose KV was reused
    num_evicted_blocks: int  # published blocks whose slot was taken for new tokens

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_query_tokens if self.num_query_tokens else 0.0


class BlockManager:
    """Allocates KV blocks to requests, with reference counts and a prefix cache.

    Typical use by the step scheduler:

    - admission: `hits = find_cached_blocks(request)`, then
      `allocate_slots(request, n, hits)` reuses the hits, sets
      `request.num_computed_tokens` to the tokens they hold and adds blocks for `n` more;
    - each later step: `allocate_slots(request, n)` grows `block_ids` to cover `n` more;
    - once a step has run: `cache_full_blocks(request)` publishes the blocks it filled;
    - at the end (finish, abort, preemption): `free(request)`.
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True
    ) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._blocks = [_Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # unpublished, unreferenced
        # Published but unreferenced blocks, least recently used first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Per request: the hash chain of its full blocks (filled lazily; tokens only ever
        # get appended, so it stays valid) and how many of its blocks were published.
        self._hashes: dict[str, list[int]] = {}
        self._num_published: dict[str, int] = {}
        self._num_query_tokens = 0
        self._num_hit_tokens = 0
        self._num_evicted_blocks = 0

    # ----------------------------------------------------------------- inspection

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation may take, including evictable cached ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently published in the prefix cache (in use or evictable)."""
        return len(self._cached)

    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request."""
        return self.num_used_blocks / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._blocks[block_id].ref_count

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(
            num_query_tokens=self._num_query_tokens,
            num_hit_tokens=self._num_hit_tokens,
            num_evicted_blocks=self._num_evicted_blocks,
        )

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # ----------------------------------------------------------------- prefix cache

    def find_cached_blocks(self, request: Request) -> list[int]:
        """Published blocks holding the longest cached prefix of a request without blocks.

        Only full blocks before the last token count: the last token must always be
        computed, since its forward pass yields the logits of the next one. Nothing is
        reserved; pass the result to `allocate_slots` in the same scheduling pass.
        """
        if not self.enable_prefix_caching or request.block_ids:
            return []
        if request.needs_prompt_logprobs:
            return []  # cached positions would never be computed, nor their logprobs
        num_full = (request.num_tokens - 1) // self.block_size
        if num_full == 0:
            return []
        # Not memoised: only requests holding blocks keep a hash chain, so a chain can
        # never outlive the tokens it was computed from.
        hashes = self._chain_hashes(request, num_full, [])
        size = self.block_size
        hits: list[int] = []
        for i in range(num_full):
            block_id = self._cached.get(hashes[i])
            if block_id is None:
                break
            if self._blocks[block_id].token_ids != tuple(
                request.token_range(i * size, (i + 1) * size)
            ):
                break
            hits.append(block_id)
        return hits

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full of computed tokens.

        Call only once the KV of `request.num_computed_tokens` tokens has been written
        (after the step that computed them ran), or another request could reuse a block
        whose KV does not exist yet.
        """
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        start = self._num_published.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._chain_hashes(
            request, num_full, self._hashes.setdefault(request.request_id, [])
        )
        size = self.block_size
        for i in range(start, num_full):
            block = self._blocks[request.block_ids[i]]
            # A block reused from the cache is already published; a block whose hash is
            # already published elsewhere (two requests computed the same prefix in the
            # same step) stays private and is simply freed later.
            if block.block_hash is None and hashes[i] not in self._cached:
                block.block_hash = hashes[i]
                block.token_ids = tuple(request.token_range(i * size, (i + 1) * size))
                self._cached[hashes[i]] = block.block_id
        self._num_published[request.request_id] = num_full

    def _chain_hashes(self, request: Request, num_full: int, hashes: list[int]) -> list[int]:
        """Extend `hashes` to the chain of the request's first `num_full` blocks."""
        if len(hashes) < num_full:
            size = self.block_size
            parent = hashes[-1] if hashes else _ROOT_HASH
            for i in range(len(hashes), num_full):
                parent = hash((parent, tuple(request.token_range(i * size, (i + 1) * size))))
                hashes.append(parent)
        return hashes

    # ----------------------------------------------------------------- allocation

    def num_blocks_to_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
        *,
        released: Iterable[Request] = (),
    ) -> int:
        """Free blocks that `allocate_slots(request, num_new_tokens, cached_blocks)` takes.

        Cache hits nobody references come out of the free pool too. `released` asks the
        question as if those requests had been freed first (to size a preemption).
        """
        num_held, num_computed = self._held(request, cached_blocks)
        num_new_blocks = max(0, self.num_blocks_for(num_computed + num_new_tokens) - num_held)
        if not cached_blocks:
            return num_new_blocks
        counts = Counter(b for r in released for b in r.block_ids)
        num_idle_hits = sum(1 for b in cached_blocks if self._blocks[b].ref_count - counts[b] == 0)
        return num_new_blocks + num_idle_hits

    def num_free_blocks_after_release(self, requests: Iterable[Request]) -> int:
        """`num_free_blocks` as it would be once `requests` were freed."""
        if isinstance(requests, list | tuple) and not requests:
            return self.num_free_blocks  # the common question: nobody released
        counts = Counter(b for r in requests for b in r.block_ids)
        released = sum(1 for b, n in counts.items() if self._blocks[b].ref_count == n)
        return self.num_free_blocks + released

    def max_new_tokens(
        self, request: Request, cached_blocks: Sequence[int] = (), *, reserve_blocks: int = 0
    ) -> int:
        """How many tokens past the computed ones fit in the request's blocks plus the
        free pool, keeping `reserve_blocks` free."""
        num_held, num_computed = self._held(request, cached_blocks)
        available = self.num_free_blocks - reserve_blocks
        available -= self.num_blocks_to_allocate(request, 0, cached_blocks) if cached_blocks else 0
        if available < 0:
            return 0
        return max(0, (num_held + available) * self.block_size - num_computed)

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_blocks: Sequence[int] = (),
        *,
        reserve_blocks: int = 0,
    ) -> bool:
        """Grow `request.block_ids` to cover `num_new_tokens` more tokens.

        On admission pass the hits of `find_cached_blocks`: they become the request's
        first blocks and `request.num_computed_tokens` is set to the tokens they hold
        (`num_cached_tokens` too, on a first admission). Returns False, changing nothing,
        when that would leave fewer than `reserve_blocks` free blocks.
        """
        if num_new_tokens < 0:
            raise ValueError("num_new_tokens must be >= 0")
        if cached_blocks and request.block_ids:
            raise ValueError("cache hits can only start a request that holds no blocks")
        if request.block_ids and len(request.block_ids) * self.block_size >= (
            request.num_computed_tokens + num_new_tokens
        ):
            return True  # the common decode step: the last block still has room
        needed = self.num_blocks_to_allocate(request, num_new_tokens, cached_blocks)
        if needed > self.num_free_blocks - reserve_blocks:
            return False
        if not request.block_ids:
            # Taking the hits first keeps them from being evicted by the fresh blocks below.
            for block_id in cached_blocks:
                self._take(block_id)
            request.block_ids = list(cached_blocks)
            num_cached_tokens = len(cached_blocks) * self.block_size
            request.num_computed_tokens = num_cached_tokens
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = min(num_cached_tokens, request.num_prompt_tokens)
            self._num_published[request.request_id] = len(cached_blocks)
            self._num_query_tokens += request.num_tokens
            self._num_hit_tokens += num_cached_tokens
        num_total = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        while len(request.block_ids) < num_total:
            block_id = self._pop_free()
            self._blocks[block_id].ref_count = 1
            request.block_ids.append(block_id)
        return True

    def free(self, request: Request) -> None:
        """Drop the request's references; published blocks stay cached until evicted."""
        # Tail blocks first, so that under pressure a prefix is evicted from its end and
        # its head (shared by more requests) survives longest.
        for block_id in reversed(request.block_ids):
            block = self._blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None
        request.block_ids = []
        self._hashes.pop(request.request_id, None)
        self._num_published.pop(request.request_id, None)

    def _held(self, request: Request, cached_blocks: Sequence[int]) -> tuple[int, int]:
        if cached_blocks:
            return len(cached_blocks), len(cached_blocks) * self.block_size
        return len(request.block_ids), request.num_computed_tokens

    def _take(self, block_id: int) -> None:
        block = self._blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        if self._free:
            return self._free.popleft()
        block_id, _ = self._evictable.popitem(last=False)
        block = self._blocks[block_id]
        if block.block_hash is not None:
            del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        self._num_evicted_blocks += 1
        return block_id
