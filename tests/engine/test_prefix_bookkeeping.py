"""Prefix caching, admission order and whole-image chunks in the bookkeeping, without tensors."""

from batchvl.engine.request import MediaSpan, Request
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.scheduling.block_manager import BlockManager
from batchvl.engine.scheduling.prefix_cache import extend_block_hashes
from batchvl.engine.scheduling.scheduler import Scheduler

PAD = 99  # a placeholder token id: equal for every image


def request_with_image(request_id: int, image_hash: str, text: list[int], before: int = 6, length: int = 8):
    """`before` system tokens, an image of `length` placeholders, then `text`."""
    ids = list(range(before)) + [PAD] * length + text
    return Request(request_id, ids, [MediaSpan(before, length, image_hash)], SamplingParams(max_new_tokens=4))


def run_step(scheduler: Scheduler):
    chunks = scheduler.schedule().chunks
    scheduler.commit(chunks)
    for chunk in chunks:
        if chunk.samples_next_token:
            chunk.request.output_token_ids.append(7)
    return chunks


def test_block_hashes_chain_over_tokens_and_image_content():
    a = request_with_image(0, "image-a", [1, 2, 3, 4, 5, 6])
    same = request_with_image(1, "image-a", [1, 2, 3, 4, 5, 9])
    other_image = request_with_image(2, "image-b", [1, 2, 3, 4, 5, 6])
    hashes = {r.request_id: extend_block_hashes(r, 4, 5) for r in (a, same, other_image)}
    # blocks of 4: [0-3] text, [4-7] text + image start, [8-11] image, [12-15] image end + text, [16-19]
    assert hashes[0][:4] == hashes[1][:4] and hashes[0][4] != hashes[1][4]
    assert hashes[0][0] == hashes[2][0]  # the system text before the image is shared...
    assert all(hashes[0][i] != hashes[2][i] for i in range(1, 5))  # ...nothing from the image block on
    assert len(extend_block_hashes(a, 4, 100)) == a.num_tokens // 4  # only full blocks get a hash


def test_cached_prefix_is_shared_and_kept_after_free():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = request_with_image(0, "image-a", [1, 2, 3, 4, 5, 6])  # 20 tokens: 5 full blocks
    manager.admit(first, [], first.num_tokens)
    first.num_computed_tokens = first.num_tokens
    manager.register_full_blocks(first)
    assert manager.num_cached_blocks == 5
    second = request_with_image(1, "image-a", [1, 2, 3, 4, 5, 9])
    cached = manager.cached_prefix(second)
    assert cached == first.block_ids[:4]  # the 5th block holds a different last token
    manager.admit(second, cached, second.num_tokens - 16)
    assert second.num_computed_tokens == 16  # all from the cache: nothing of it was computed yet
    assert second.block_ids[:4] == first.block_ids[:4] and len(second.block_ids) == 5
    manager.free(first)
    manager.free(second)
    assert manager.num_free_blocks == 16 and manager.num_cached_blocks == 5  # freed but still cached
    again = request_with_image(2, "image-a", [1, 2, 3, 4, 5, 6])
    assert len(manager.cached_prefix(again)) == 4  # a whole cached prompt still leaves one block to compute


def test_cached_blocks_are_evicted_least_recent_first_when_space_runs_out():
    manager = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    first = request_with_image(0, "image-a", [1, 2])  # 16 tokens: 4 blocks
    manager.admit(first, [], 16)
    first.num_computed_tokens = 16
    manager.register_full_blocks(first)
    first_blocks = list(first.block_ids)
    manager.free(first)
    big = Request(1, list(range(100, 120)), [], SamplingParams())  # 5 blocks: 2 plain + 3 evicted
    assert manager.can_allocate(big, 20)
    manager.allocate(big, 20)
    assert manager.num_cached_blocks == 1
    assert manager.cached_prefix(request_with_image(2, "image-a", [1, 2])) == first_blocks[:1]


def test_a_prompt_of_the_same_sample_waits_for_the_shared_prefix_then_reuses_it():
    manager = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(8, 100, manager)
    first = request_with_image(0, "image-a", [1, 2, 3, 4, 5, 6])
    second = request_with_image(1, "image-a", [1, 2, 3, 4, 8, 9])
    other = request_with_image(2, "image-b", [1, 2, 3, 4, 5, 6])
    for request in (first, second, other):
        scheduler.add(request)
    chunks = run_step(scheduler)
    # `second` would recompute the system prompt + image that `first` computes in this very step, and
    # `other` its system prompt: both wait one step
    assert [c.request.request_id for c in chunks] == [0]
    assert manager.num_cached_blocks == 5
    chunks = run_step(scheduler)
    # `second` starts after the cached system prompt + image (16 tokens); `other` after the one block
    # before its (different) image (4 tokens)
    assert [(c.request.request_id, c.start) for c in chunks] == [(0, 20), (1, 16), (2, 4)]
    assert scheduler.num_prefix_cached_tokens == 16 + 4


def test_prefix_caching_off_matches_nothing():
    manager = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(8, 100, manager)
    for request_id in range(2):
        scheduler.add(request_with_image(request_id, "image-a", [1, 2]))
    assert [c.start for c in run_step(scheduler)] == [0, 0]
    assert manager.num_cached_blocks == 0


def test_admission_is_cheapest_image_first_and_nothing_waits_forever():
    scheduler = Scheduler(1, 1000, BlockManager(256, 4), lookahead=3)
    big = request_with_image(0, "big", [1], length=40)
    scheduler.add(big)
    for request_id in range(1, 5):
        scheduler.add(request_with_image(request_id, f"small{request_id}", [1], length=4))
    order = []
    for _ in range(5):
        (chunk,) = run_step(scheduler)
        order.append(chunk.request.request_id)
        scheduler.finish(chunk.request)
        scheduler.add(request_with_image(10 + len(order), "small", [1], length=4))  # small ones keep coming
    # small first; after 3 admissions that passed it over, the big one goes
    assert order == [1, 2, 3, 0, 4]


def test_a_request_counts_the_admissions_that_pass_it_over_from_its_arrival():
    scheduler = Scheduler(1, 1000, BlockManager(256, 4), lookahead=2)
    for request_id in (1, 2):
        scheduler.add(request_with_image(request_id, f"small{request_id}", [1], length=4))
    for _ in range(2):
        (chunk,) = run_step(scheduler)
        scheduler.finish(chunk.request)
    # two admissions happened before the big one arrived: they do not make it overdue
    scheduler.add(request_with_image(3, "big", [1], length=40))
    scheduler.add(request_with_image(4, "small4", [1], length=4))
    (chunk,) = run_step(scheduler)
    assert chunk.request.request_id == 4


def test_lookahead_one_is_arrival_order():
    scheduler = Scheduler(1, 1000, BlockManager(256, 4), lookahead=1)
    scheduler.add(request_with_image(0, "big", [1], length=40))
    scheduler.add(request_with_image(1, "small", [1], length=4))
    (chunk,) = run_step(scheduler)
    assert chunk.request.request_id == 0


def test_disable_chunked_mm_input_keeps_each_image_in_one_chunk():
    scheduler = Scheduler(8, 10, BlockManager(64, 4), disable_chunked_mm_input=True)
    request = request_with_image(0, "a", [1, 2, 3], before=6, length=8)  # image at [6, 14)
    scheduler.add(request)
    sizes = [c.num_tokens for c in (run_step(scheduler) + run_step(scheduler) + run_step(scheduler))]
    assert sizes == [6, 10, 1]  # stops before the image, then the whole image and what fits after it
    chunked = Scheduler(8, 10, BlockManager(64, 4))
    chunked.add(request_with_image(0, "a", [1, 2, 3], before=6, length=8))
    assert [c.num_tokens for c in run_step(chunked) + run_step(chunked)] == [10, 7]


def test_admission_favours_the_oldest_shard_then_the_cheapest_image():
    scheduler = Scheduler(1, 1000, BlockManager(256, 4), lookahead=8)
    arrivals = [(0, 1, 4), (1, 0, 40), (2, 1, 2), (3, 0, 20), (4, 2, 1)]  # (id, shard position, image)
    for request_id, shard, length in arrivals:
        request = request_with_image(request_id, f"image{request_id}", [1], length=length)
        request.priority = shard
        scheduler.add(request)
    order = []
    for _ in arrivals:
        (chunk,) = run_step(scheduler)
        order.append(chunk.request.request_id)
        scheduler.finish(chunk.request)
    assert order == [3, 1, 2, 0, 4]
