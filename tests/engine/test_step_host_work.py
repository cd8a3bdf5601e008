"""A decode step's bookkeeping grows with the tokens it adds, not with the context: with prefix caching on
(a job's default), every step walked every full block of every running request to offer it to the prefix
cache again, 2 ms a step at 256 decodes of 600 tokens."""

import batchvl.engine.scheduling.block_manager as block_manager_module
from batchvl.config import EngineConfig
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams


def test_a_decode_step_offers_the_prefix_cache_only_the_blocks_it_filled(loaded_fp32, monkeypatch):
    config = EngineConfig(block_size=16, prefix_caching=True)
    engine = Engine(loaded_fp32.adapter, loaded_fp32.processor.tokenizer, config, loaded_fp32.eos_token_ids())
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True)
    # Prompts of 5..12 blocks less a token or two: some requests fill a block in the first decode steps
    for i in range(8):
        engine.add_request(EngineRequest([100 + i] * (16 * (5 + i) - i % 3), [], sampling, tag=i))
    while engine.scheduler.waiting or any(not r.is_prefill_done for r in engine.scheduler.running):
        engine.step()
    hashed = []
    extend = block_manager_module.extend_block_hashes
    monkeypatch.setattr(
        block_manager_module,
        "extend_block_hashes",
        lambda request, size, count: hashed.append(request.request_id) or extend(request, size, count),
    )
    for _ in range(20):
        running = list(engine.scheduler.running)
        full_before = {r.request_id: r.num_computed_tokens // 16 for r in running}
        hashed.clear()
        assert not engine.step()  # every request decodes, none finishes
        filled = [r.request_id for r in running if r.num_computed_tokens // 16 > full_before[r.request_id]]
        assert sorted(hashed) == sorted(filled)
    assert engine.block_manager.num_cached_blocks == sum(len(r.block_ids) for r in running) - sum(
        1 for r in running if r.num_computed_tokens % 16
    )  # every full block was published once
