"""A step's chunks packed for the forward (`PackedStep`) as a plain loop over its tokens packs them: each
chunk's tokens and positions in its rows, the padding's after them, the sampled and scored rows, and the
sequences attended one by one."""

import numpy as np
import pytest
import torch

from batchvl.engine.packed_step import PackedStep
from batchvl.engine.request import Request, RequestPositions, ScheduledChunk
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.scheduling.block_manager import BlockManager
from batchvl.layers.row_buckets import bucket_rows

AXES = 3  # M-RoPE's


def request(request_id: int, prompt: int, output: int, delta: int, score_from: int | None = None) -> Request:
    """A request of `prompt` prompt tokens and `output` generated ones, its prompt's positions distinct on
    each axis (as an image's are), generated token i at i + delta."""
    made = Request(
        request_id,
        [1000 + 10 * request_id + i for i in range(prompt)],
        [],
        SamplingParams(8),
        output_token_ids=[500 + 10 * request_id + i for i in range(output)],
        score_from=score_from,
    )
    axis = torch.arange(prompt)
    made.positions = RequestPositions(torch.stack([axis, axis * 2, axis * 3 + request_id]), delta)
    return made


def step_requests(manager: BlockManager) -> list[Request]:
    requests = [
        request(0, 9, 4, delta=-3),  # decoding
        request(1, 12, 0, delta=0),  # a prompt chunk cut inside
        request(2, 7, 3, delta=5),  # decoding
        request(3, 6, 3, delta=2),  # recomputed after a preemption: a chunk over prompt and output
        request(4, 5, 2, delta=1),  # recomputed: one generated token that is not its last
        request(5, 10, 0, delta=0, score_from=7),  # a scoring request's chunk
    ]
    for r in requests:
        manager.admit(r, [], r.num_tokens)
    return requests


def chunks_of(requests: list[Request]) -> list[ScheduledChunk]:
    return [
        ScheduledChunk(requests[0], 12, 1),
        ScheduledChunk(requests[1], 4, 5),
        ScheduledChunk(requests[2], 9, 1),
        ScheduledChunk(requests[3], 4, 5),
        ScheduledChunk(requests[4], 5, 1),
        ScheduledChunk(requests[5], 2, 8),
    ]


def expected(chunks: list[ScheduledChunk]) -> dict:
    """The packing, token by token."""
    tokens, positions, last_rows, scored_rows = [], [], [], []
    for chunk in chunks:
        r = chunk.request
        first = len(tokens)
        for position in range(chunk.start, chunk.end):
            num_prompt = len(r.prompt_token_ids)
            if position < num_prompt:
                tokens.append(r.prompt_token_ids[position])
                positions.append(r.positions.prompt[:, position].tolist())
            else:
                tokens.append(r.output_token_ids[position - num_prompt])
                positions.append([position + r.positions.delta] * AXES)
        if chunk.samples_next_token:
            last_rows.append(len(tokens) - 1)
        elif r.score_from is not None:
            scored = [p for p in range(chunk.start, chunk.end) if r.score_from - 1 <= p < r.num_tokens - 1]
            scored_rows += [first + p - chunk.start for p in scored]
    padding = bucket_rows(len(tokens)) - len(tokens)
    return {
        "tokens": tokens + [0] * padding,
        "positions": positions + [[0] * AXES] * padding,
        "last_rows": last_rows,
        "scored_rows": scored_rows,
    }


@pytest.mark.parametrize("in_place", [True, False], ids=["decodes-in-place", "every-chunk-a-sequence"])
def test_the_packed_step_is_the_chunks_tokens_in_order(in_place):
    manager = BlockManager(64, 4, max_running=8)
    chunks = chunks_of(step_requests(manager))
    packed = PackedStep.of(chunks, in_place, manager, pad=True)
    want = expected(chunks)
    assert packed.token_ids.tolist() == want["tokens"]
    assert packed.positions.T.tolist() == want["positions"]
    assert (
        packed.last_rows.tolist() == want["last_rows"] == [0, 6, 11]
    )  # the decodes, and the recomputed chunk
    # that reaches its request's end
    assert packed.scored_rows.tolist() == want["scored_rows"]
    counts = [chunk.num_tokens for chunk in chunks]
    assert packed.counts.tolist() == counts
    assert packed.starts.tolist() == [chunk.start for chunk in chunks]
    assert packed.first_rows.tolist() == np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
    assert packed.table_rows.tolist() == [chunk.request.table_row for chunk in chunks]
    attended = [i for i, chunk in enumerate(chunks) if chunk.num_tokens > 1 or not in_place]
    assert [(s.query_start, s.num_queries, s.num_keys) for s in packed.sequences] == [
        (int(packed.first_rows[i]), chunks[i].num_tokens, chunks[i].end) for i in attended
    ]
    for sequence, i in zip(packed.sequences, attended, strict=True):
        slots, _ = manager.key_layout(chunks[i].request, chunks[i].end)
        assert np.array_equal(sequence.key_slots, slots)


def test_a_step_not_padded_has_its_chunks_rows_alone():
    # a GPU's step (`row_buckets.pads_rows`): the padded step's rows before its padding, and nothing else
    manager = BlockManager(64, 4, max_running=8)
    chunks = chunks_of(step_requests(manager))
    padded, alone = (PackedStep.of(chunks, True, manager, pad=pad) for pad in (True, False))
    total = sum(chunk.num_tokens for chunk in chunks)
    assert len(padded.token_ids) == bucket_rows(total) > total
    assert alone.token_ids.tolist() == padded.token_ids[:total].tolist()
    assert torch.equal(alone.positions, padded.positions[:, :total])
    for name in ("table_rows", "starts", "counts", "first_rows", "last_rows", "scored_rows"):
        assert np.array_equal(getattr(alone, name), getattr(padded, name)), name
