"""The step whose activations size the GPU's KV cache: the largest the config lets the scheduler make, and
no larger. One token over `max_num_batched_tokens` would measure a step the engine never runs; one under,
or one request too few, a peak below the one it reaches."""

import pytest

from batchvl.config import EngineConfig
from batchvl.engine.scheduling import activation_peak


@pytest.mark.parametrize(
    ("tokens", "seqs"),
    [(300, 7), (64, 64), (5, 64), (257, 16)],
    ids=["uneven-split", "one-token-each", "fewer-tokens-than-seqs", "one-over-a-multiple"],
)
def test_the_largest_step_packs_exactly_the_token_budget(loaded_fp32, monkeypatch, tokens, seqs):
    config = EngineConfig(max_num_batched_tokens=tokens, max_num_seqs=seqs, block_size=16)
    steps = []
    execute = activation_peak.ModelRunner.execute

    def recording(runner, chunks, embeddings):
        steps.append(
            [(chunk.start, chunk.num_tokens, len(chunk.request.prompt_token_ids)) for chunk in chunks]
        )
        return execute(runner, chunks, embeddings)

    monkeypatch.setattr(activation_peak.ModelRunner, "execute", recording)
    activation_peak.largest_step(loaded_fp32.adapter, config)()
    (chunks,) = steps
    assert sum(num_tokens for _, num_tokens, _ in chunks) == tokens
    assert len(chunks) == min(seqs, tokens)  # every request the budget allows, each its own sample
    # each a whole prompt from its first token, the prompts as even as the budget divides
    assert all(start == 0 and num_tokens == prompt for start, num_tokens, prompt in chunks)
    assert max(n for _, n, _ in chunks) - min(n for _, n, _ in chunks) <= 1
