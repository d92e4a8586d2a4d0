"""Block manager: allocation, reference counts, prefix cache hits and LRU eviction."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager
from engine.request import Request, RequestStatus, SamplingParams


def make_request(request_id: str, prompt: list[int]) -> Request:
    return Request(request_id, list(prompt), SamplingParams(max_tokens=8))


def compute(bm: BlockManager, request: Request, num_tokens: int) -> None:
    """Allocate and 'run' `num_tokens` more tokens, then publish the full blocks."""
    assert bm.allocate_slots(request, num_tokens)
    request.num_computed_tokens += num_tokens
    bm.cache_full_blocks(request)


def admit(bm: BlockManager, request: Request, *, reserve_blocks: int = 0) -> bool:
    """Admission as the step scheduler does it: reuse hits, then allocate the rest."""
    hits = bm.find_cached_blocks(request)
    num_new = request.num_tokens - len(hits) * bm.block_size
    if not bm.allocate_slots(request, num_new, hits, reserve_blocks=reserve_blocks):
        return False
    request.num_computed_tokens += num_new
    bm.cache_full_blocks(request)
    return True


def test_constructor_validates() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, -1)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, True)


def test_allocate_grow_and_free() -> None:
    bm = BlockManager(8, 4)
    request = make_request("a", list(range(6)))
    assert bm.num_free_blocks == 8
    assert bm.usage() == 0.0
    compute(bm, request, 6)
    assert len(request.block_ids) == 2
    assert bm.num_free_blocks == 6
    assert bm.usage() == pytest.approx(2 / 8)
    compute(bm, request, 2)  # fills block 2 exactly
    assert len(request.block_ids) == 2
    compute(bm, request, 1)
    assert len(request.block_ids) == 3
    assert len(set(request.block_ids)) == 3
    bm.free(request)
    assert request.block_ids == []
    assert bm.num_free_blocks == 8


def test_allocation_that_does_not_fit_changes_nothing() -> None:
    bm = BlockManager(4, 4)
    hog = make_request("hog", list(range(12)))
    compute(bm, hog, 12)
    request = make_request("r", list(range(100, 109)))
    assert not bm.allocate_slots(request, 9)
    assert request.block_ids == []
    assert bm.num_free_blocks == 1
    assert not bm.allocate_slots(request, 4, reserve_blocks=1)
    assert bm.allocate_slots(request, 4)
    assert bm.num_free_blocks == 0
    with pytest.raises(ValueError, match=">= 0"):
        bm.allocate_slots(request, -1)


def test_prefix_hit_reuses_blocks_and_sets_computed_tokens() -> None:
    bm = BlockManager(16, 4)
    first = make_request("first", list(range(10)))
    admit(bm, first)
    assert bm.num_cached_blocks == 2  # two full blocks; the third holds 2 tokens
    second = make_request("second", [*range(10), 99])
    hits = bm.find_cached_blocks(second)
    assert hits == first.block_ids[:2]
    assert bm.num_blocks_to_allocate(second, 3, hits) == 1  # hits are in use: free
    assert bm.allocate_slots(second, 3, hits)
    assert second.num_computed_tokens == 8
    assert second.num_cached_tokens == 8
    assert second.block_ids[:2] == first.block_ids[:2]
    assert second.block_ids[2] != first.block_ids[2]
    for block_id in hits:
        assert bm.ref_count(block_id) == 2
    stats = bm.prefix_cache_stats
    assert stats.num_hit_tokens == 8
    assert stats.num_query_tokens == 10 + 11
    assert stats.hit_rate == pytest.approx(8 / 21)


def test_last_token_is_never_served_from_cache() -> None:
    bm = BlockManager(16, 4)
    admit(bm, make_request("first", list(range(8))))
    # Same 8 tokens: both blocks are cached, but the 8th token must be computed.
    again = make_request("again", list(range(8)))
    assert len(bm.find_cached_blocks(again)) == 1
    assert len(bm.find_cached_blocks(make_request("longer", list(range(9))))) == 2


def test_prefix_hit_needs_the_whole_chain() -> None:
    bm = BlockManager(16, 4)
    admit(bm, make_request("first", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, different first block: the chained hash differs.
    assert bm.find_cached_blocks(make_request("x", [0, 2, 3, 4, 5, 6, 7, 8, 9])) == []
    assert len(bm.find_cached_blocks(make_request("y", [1, 2, 3, 4, 0, 0, 0, 0, 9]))) == 1


def test_freed_cached_blocks_stay_reusable_until_evicted_lru_first() -> None:
    bm = BlockManager(6, 2)
    old = make_request("old", [1, 1, 2, 2, 3])  # full blocks [1,1] [2,2]
    admit(bm, old)
    new = make_request("new", [7, 7, 8, 8, 9])
    admit(bm, new)
    old_blocks, new_blocks = list(old.block_ids), list(new.block_ids)
    bm.free(old)
    bm.free(new)
    assert bm.num_free_blocks == 6
    assert bm.num_cached_blocks == 4
    # Resuming "old" hits its blocks although nobody holds them.
    probe = make_request("probe", [1, 1, 2, 2, 5])
    assert bm.find_cached_blocks(probe) == old_blocks[:2]
    # Filling the cache with fresh blocks evicts the least recently used first: the two
    # never-published tail blocks, then "old" (tail block first), then "new".
    filler = make_request("filler", list(range(100, 106)))
    compute(bm, filler, 4)
    assert bm.prefix_cache_stats.num_evicted_blocks == 0
    compute(bm, filler, 2)
    assert bm.prefix_cache_stats.num_evicted_blocks == 1
    assert old_blocks[1] in filler.block_ids
    assert bm.find_cached_blocks(probe) == old_blocks[:1]
    assert bm.find_cached_blocks(make_request("n", [7, 7, 8, 8, 9])) == new_blocks[:2]


def test_hit_on_an_evictable_block_takes_it_out_of_the_free_pool() -> None:
    bm = BlockManager(4, 2)
    first = make_request("first", [1, 1, 2, 2, 3])
    admit(bm, first)
    bm.free(first)
    second = make_request("second", [1, 1, 2, 2, 4])
    hits = bm.find_cached_blocks(second)
    assert len(hits) == 2
    assert bm.num_blocks_to_allocate(second, 1, hits) == 3  # two idle hits + one new
    assert bm.max_new_tokens(second, hits) == (2 + 2) * 2 - 4
    assert bm.allocate_slots(second, 1, hits)
    assert bm.num_free_blocks == 1
    # Allocating the new block did not evict the hits it had just taken.
    assert second.block_ids[:2] == hits
    assert all(bm.ref_count(b) == 1 for b in second.block_ids)


def test_resumed_request_with_outputs_hits_its_own_blocks() -> None:
    bm = BlockManager(16, 2)
    request = make_request("r", [5, 6, 7])
    admit(bm, request)
    request.output_token_ids += [8]
    compute(bm, request, 1)
    request.output_token_ids += [9]
    before = list(request.block_ids)
    bm.free(request)  # preempted
    request.num_computed_tokens = 0
    request.status = RequestStatus.PREEMPTED
    hits = bm.find_cached_blocks(request)
    assert hits == before[:2]
    assert bm.allocate_slots(request, 1, hits)
    assert request.num_computed_tokens == 4
    assert request.num_cached_tokens == 0  # set by the first admission, not the resume


def test_duplicate_prefix_computed_twice_is_published_once() -> None:
    bm = BlockManager(8, 2)
    a = make_request("a", [1, 2, 3])
    b = make_request("b", [1, 2, 4])
    assert bm.allocate_slots(a, 3)
    assert bm.allocate_slots(b, 3)
    a.num_computed_tokens = b.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert bm.num_cached_blocks == 1
    bm.free(b)
    bm.free(a)
    assert bm.num_free_blocks == 8


def test_released_requests_size_a_preemption() -> None:
    bm = BlockManager(6, 2)
    shared = make_request("shared", [1, 1, 2, 2, 3])
    admit(bm, shared)
    other = make_request("other", [1, 1, 2, 2, 4])
    admit(bm, other)  # shares two blocks with "shared"
    assert bm.num_free_blocks == 2
    assert bm.num_free_blocks_after_release([other]) == 3
    assert bm.num_free_blocks_after_release([other, shared]) == 6
    newcomer = make_request("new", [1, 1, 9, 9, 9])
    hits = bm.find_cached_blocks(newcomer)
    assert len(hits) == 1
    assert bm.num_blocks_to_allocate(newcomer, 3, hits) == 2
    # Once both holders are gone the hit is idle, and taking it costs a free block.
    assert bm.num_blocks_to_allocate(newcomer, 3, hits, released=[shared, other]) == 3


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    first = make_request("first", [1, 2, 3, 4, 5])
    admit(bm, first)
    assert bm.num_cached_blocks == 0
    assert bm.find_cached_blocks(make_request("again", [1, 2, 3, 4, 5])) == []
    bm.free(first)
    assert bm.num_free_blocks == 8


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["admit", "grow", "free"]),
            st.integers(0, 9),
            st.lists(st.integers(0, 2), min_size=1, max_size=12),
        ),
        max_size=60,
    ),
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 3, 4]),
)
def test_random_operations_keep_counts_exact(ops, num_blocks, block_size) -> None:
    bm = BlockManager(num_blocks, block_size)
    live: dict[int, Request] = {}
    # Slot contents: the prefix each slot was computed for. A hit must find its own.
    kv: dict[tuple[int, int], tuple[int, ...]] = {}
    for op, key, tokens in ops:
        request = live.get(key)
        if op == "admit" and request is None:
            request = make_request(f"r{key}", tokens)
            hits = bm.find_cached_blocks(request)
            for i, block_id in enumerate(hits):
                for slot in range(block_size):
                    pos = i * block_size + slot
                    assert kv[(block_id, slot)] == tuple(tokens[: pos + 1])
            num_new = request.num_tokens - len(hits) * block_size
            if bm.allocate_slots(request, num_new, hits):
                run(bm, request, num_new, kv)
                live[key] = request
            else:
                assert request.block_ids == []
        elif op == "grow" and request is not None:
            request.output_token_ids.append(tokens[0])
            if bm.allocate_slots(request, 1):
                run(bm, request, 1, kv)
            else:
                request.output_token_ids.pop()
        elif op == "free" and request is not None:
            bm.free(request)
            del live[key]
        refs = Counter(b for r in live.values() for b in r.block_ids)
        assert all(bm.ref_count(b) == refs[b] for b in range(num_blocks))
        assert bm.num_free_blocks == num_blocks - len(refs)
    for request in live.values():
        bm.free(request)
    assert bm.num_free_blocks == num_blocks


def run(bm: BlockManager, request: Request, num_tokens: int, kv: dict) -> None:
    tokens = request.all_token_ids
    size = bm.block_size
    for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_tokens):
        block_id = request.block_ids[pos // size]
        assert bm.ref_count(block_id) == 1, "wrote into a shared block"
        kv[(block_id, pos % size)] = tuple(tokens[: pos + 1])
    request.num_computed_tokens += num_tokens
    bm.cache_full_blocks(request)


@given(
    prompt=st.lists(st.integers(0, 900), min_size=1, max_size=40),
    output=st.lists(st.integers(0, 900), max_size=40),
    data=st.data(),
)
def test_a_token_range_is_that_slice_of_all_the_tokens(prompt, output, data) -> None:
    request = Request("r", prompt, SamplingParams(max_tokens=64), output_token_ids=output)
    total = len(prompt) + len(output)
    start = data.draw(st.integers(0, total))
    end = data.draw(st.integers(start, total))
    assert request.token_range(start, end) == request.all_token_ids[start:end]
