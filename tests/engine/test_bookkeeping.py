"""Scheduler, block manager and encoder-cache bookkeeping, without tensors."""

import pytest

from batchvl.engine.encoder_cache.bookkeeping import EncoderCacheManager
from batchvl.engine.request import MediaSpan, Request, RequestStatus
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.scheduling.block_manager import BlockManager
from batchvl.engine.scheduling.scheduler import Scheduler


def make_request(request_id: int, num_prompt: int, images=()) -> Request:
    return Request(request_id, list(range(num_prompt)), list(images), SamplingParams(max_new_tokens=4))


def run_step(scheduler: Scheduler, new_token: int = 7):
    """Schedule, mark computed, append one output token to requests whose chunk reached the end."""
    chunks = scheduler.schedule().chunks
    scheduler.commit(chunks)
    for chunk in chunks:
        if chunk.samples_next_token:
            chunk.request.output_token_ids.append(new_token)
    return chunks


def test_block_manager_allocates_whole_blocks_and_frees():
    manager = BlockManager(num_blocks=4, block_size=4)
    request = make_request(0, 6)
    assert manager.can_allocate(request, 6)
    manager.allocate(request, 6)
    assert len(request.block_ids) == 2 and manager.num_free_blocks == 2
    request.num_computed_tokens = 6
    manager.allocate(request, 2)  # positions 6, 7 still fit in block 2
    assert len(request.block_ids) == 2
    manager.allocate(request, 3)  # positions 6..8 need a third block
    assert len(request.block_ids) == 3
    assert not manager.can_allocate(make_request(1, 9), 9)
    manager.free(request)
    assert request.block_ids == [] and manager.num_free_blocks == 4


def test_block_manager_slots_follow_block_table():
    manager = BlockManager(num_blocks=8, block_size=4)
    manager.allocate(make_request(9, 3), 3)  # take block 0 so the next request's table is not the identity
    request = make_request(0, 6)
    manager.allocate(request, 6)
    blocks = request.block_ids
    expected = [blocks[p // 4] * 4 + p % 4 for p in range(6)]
    slots, table = manager.key_layout(request, 6)
    assert slots.tolist() == expected and table.tolist() == blocks
    assert blocks == [1, 2]


def test_slots_grow_with_the_block_table_and_start_over_when_it_is_freed():
    """A request's slots and blocks are kept from step to step and only its new blocks' are added; a freed
    (finished or preempted) request's blocks are gone, and its next table is someone else's blocks."""
    manager = BlockManager(num_blocks=16, block_size=4)
    request = make_request(0, 6)

    def expected(end):
        return [request.block_ids[p // 4] * 4 + p % 4 for p in range(end)], request.block_ids[: -(-end // 4)]

    manager.allocate(request, 6)
    assert layout(manager, request, 6) == expected(6)
    for end in range(7, 40):  # one token a step, a new block every fourth
        request.num_computed_tokens = end - 1
        manager.allocate(request, 1)
        assert layout(manager, request, end) == expected(end)
    manager.free(request)
    other = make_request(1, 8)
    manager.allocate(other, 8)  # takes the blocks the request just let go of
    manager.allocate(request, 12)
    assert layout(manager, request, 12) == expected(12)
    assert layout(manager, request, 5) == expected(5)  # a shorter span of the same table


def layout(manager, request, end) -> tuple[list[int], list[int]]:
    slots, blocks = manager.key_layout(request, end)
    return slots.tolist(), blocks.tolist()


def test_chunked_prefill_splits_prompt_by_budget():
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=5, block_manager=BlockManager(16, 4))
    request = make_request(0, 12)
    scheduler.add(request)
    sizes = []
    while not request.output_token_ids:
        chunks = run_step(scheduler)
        sizes.append([(c.start, c.num_tokens) for c in chunks])
    assert sizes == [[(0, 5)], [(5, 5)], [(10, 2)]]
    assert request.num_computed_tokens == 12
    # decode: one token per step
    assert [(c.start, c.num_tokens) for c in run_step(scheduler)] == [(12, 1)]


def test_budget_is_shared_between_decode_and_new_prefill():
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=6, block_manager=BlockManager(32, 4))
    first, second = make_request(0, 3), make_request(1, 20)
    scheduler.add(first)
    run_step(scheduler)  # first prefilled
    scheduler.add(second)
    chunks = run_step(scheduler)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in chunks] == [(0, 3, 1), (1, 0, 5)]


def test_max_num_seqs_limits_running():
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=100, block_manager=BlockManager(64, 4))
    for i in range(5):
        scheduler.add(make_request(i, 3))
    chunks = run_step(scheduler)
    assert [c.request.request_id for c in chunks] == [0, 1]
    assert len(scheduler.waiting) == 3


def test_admission_stops_when_blocks_run_out():
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100, block_manager=BlockManager(3, 4))
    scheduler.add(make_request(0, 8))
    scheduler.add(make_request(1, 8))
    chunks = run_step(scheduler)
    assert [c.request.request_id for c in chunks] == [0]
    assert scheduler.waiting[0].request_id == 1


def test_preemption_frees_newest_and_recomputes_it_later():
    manager = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100, block_manager=manager)
    old, new = make_request(0, 8), make_request(1, 8)
    scheduler.add(old)
    scheduler.add(new)
    run_step(scheduler)  # both prefilled: 4 blocks used, 1 output token each
    assert manager.num_free_blocks == 0
    chunks = run_step(scheduler)  # old needs a 3rd block: new is preempted
    assert [c.request.request_id for c in chunks] == [0]
    assert new.status is RequestStatus.WAITING and new.num_computed_tokens == 0 and new.block_ids == []
    assert new.output_token_ids == [7]  # its output so far is kept and recomputed
    assert scheduler.waiting[0] is new and scheduler.num_preemptions == 1
    scheduler.finish(old)
    chunks = run_step(scheduler)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in chunks] == [(1, 0, 9)]


def test_preempting_itself_when_it_is_the_only_one():
    manager = BlockManager(num_blocks=2, block_size=4)
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=100, block_manager=manager)
    request = make_request(0, 8)
    scheduler.add(request)
    run_step(scheduler)
    chunks = scheduler.schedule().chunks  # needs a 3rd block, none exists: preempts itself, schedules nothing
    assert chunks == [] and request.status is RequestStatus.WAITING


def test_images_overlapping_chunk():
    span = MediaSpan(offset=5, length=10, content_hash="a")
    request = make_request(0, 20, [span])
    assert request.images_overlapping(0, 5) == []
    assert request.images_overlapping(0, 6) == [span]
    assert request.images_overlapping(14, 16) == [span]
    assert request.images_overlapping(15, 20) == []


def test_encoder_cache_holds_per_request_and_evicts_lru():
    cache = EncoderCacheManager(capacity_bytes=100)
    assert cache.acquire(1, "a") is False
    assert cache.insert("a", 60) == []
    assert cache.acquire(2, "b") is False
    assert cache.insert("b", 60) == []  # over budget, but both held: nothing evicted
    assert cache.used_bytes == 120
    assert cache.release(1, "a") == ["a"]  # nobody holds it and over budget: evicted
    assert "a" not in cache
    assert cache.acquire(3, "b") is True  # a second request holding b: a hit
    assert cache.release(2, "b") == [] and cache.release(3, "b") == []  # fits in budget: stays
    assert "b" in cache and cache.num_evictions == 1


def test_a_finished_or_preempted_request_lets_go_of_everything_at_once():
    cache = EncoderCacheManager(capacity_bytes=0)
    for content_hash in ("a", "b"):
        cache.acquire(7, content_hash)
        cache.insert(content_hash, 10)
    cache.acquire(8, "a")
    assert cache.release_request(7) == ["b"]  # a is still held by request 8
    assert cache.held_by(7) == set() and cache.held_by(8) == {"a"}
    assert cache.release_request(8) == ["a"]


def test_the_scheduler_plans_encodes_and_frees():
    cache = EncoderCacheManager(capacity_bytes=0)
    scheduler = Scheduler(8, 64, BlockManager(64, 4), encoder_cache=cache)
    first = make_request(0, 12, [MediaSpan(2, 4, "x")])
    second = make_request(1, 12, [MediaSpan(2, 4, "x")])
    scheduler.add(first)
    scheduler.add(second)
    plan = scheduler.schedule()
    assert plan.to_encode == [(first, "x")] and plan.num_cache_hits == 1  # one encode for both requests
    scheduler.encoded({"x": 100})
    scheduler.commit(plan.chunks)  # both prefilled past the image: they let go, and x is evicted
    assert scheduler.schedule().freed == ["x"]


def test_a_request_that_finishes_holding_images_lets_go_of_them():
    """A request lets go of an image once its placeholders are in the KV cache; one that finishes before that
    (its prefill stopped short) must not keep it held, or the entry could never be evicted."""
    cache = EncoderCacheManager(capacity_bytes=0)
    scheduler = Scheduler(8, 4, BlockManager(64, 4), encoder_cache=cache)
    request = make_request(0, 12, [MediaSpan(2, 8, "x")])
    scheduler.add(request)
    plan = scheduler.schedule()  # a chunk of 4 tokens: into the image, not past it
    scheduler.encoded({"x": 100})
    scheduler.commit(plan.chunks)
    assert cache.held_by(0) == {"x"}
    scheduler.finish(request)
    assert cache.held_by(0) == set() and scheduler.schedule().freed == ["x"]
    cache.check_integrity(set())


@pytest.mark.parametrize("num_blocks", [0, -1])
def test_block_manager_rejects_empty_cache(num_blocks):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, 4)


def test_integrity_checks_see_lost_blocks_wrong_counts_and_stray_pins():
    manager = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    request, other = make_request(0, 9), make_request(1, 5)
    manager.allocate(request, 9)
    manager.allocate(other, 5)
    manager.check_integrity([request, other])
    with pytest.raises(AssertionError, match="reference counts"):
        manager.check_integrity([request])  # a request's blocks held by nobody the engine knows
    manager._free.pop()  # a block that leaves the free list without going anywhere
    with pytest.raises(AssertionError, match="lost or counted twice"):
        manager.check_integrity([request, other])

    cache = EncoderCacheManager(capacity_bytes=100)
    cache.acquire(1, "a")
    cache.insert("a", 10)
    cache.acquire(2, "b")
    cache.insert("b", 20)
    cache.release(2, "b")
    cache.check_integrity({1, 2})
    with pytest.raises(AssertionError, match="finished or unknown request"):
        cache.check_integrity({2})  # request 1 is gone but still holds a
    cache.used_bytes += 1
    with pytest.raises(AssertionError, match="used bytes"):
        cache.check_integrity({1, 2})
