"""The running requests' block table: its rows follow the block manager's lists, its slots the blocks, and
the runner's copy on the device follows it through the changes it logs."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

import batchvl.engine.model_runner as model_runner
from batchvl.config import EngineConfig
from batchvl.engine.device.device_block_table import DeviceBlockTable
from batchvl.engine.engine import Engine
from batchvl.engine.request import EngineRequest
from batchvl.engine.sampling.params import SamplingParams
from batchvl.engine.scheduling.block_manager import BlockManager
from batchvl.engine.scheduling.block_table import BlockTable
from batchvl.layers.attention import InPlaceDecodes, decode_splits
from batchvl.layers.triton_grouped_decode import split_count
from tests.engine.test_bookkeeping import make_request


def test_a_rows_blocks_and_slots_are_the_requests():
    manager = BlockManager(num_blocks=16, block_size=4, max_running=3, max_tokens_per_request=40)
    assert manager.table.shape == (3, 10)
    first, second = make_request(0, 6), make_request(1, 9)
    manager.admit(first, [], 6)
    manager.admit(second, [], 9)
    assert first.table_row != second.table_row
    first.num_computed_tokens = 6
    manager.allocate(first, 3)  # positions 6..8: a third block
    for request in (first, second):
        row = manager.table.blocks[request.table_row, : len(request.block_ids)]
        assert row.tolist() == request.block_ids
    positions = np.arange(9)
    slots = manager.table.slots(np.full(9, first.table_row), positions)
    assert slots.tolist() == [first.block_ids[p // 4] * 4 + p % 4 for p in range(9)]
    assert slots.tolist() == manager.key_layout(first, 9)[0].tolist()
    manager.check_integrity([first, second])


def test_a_freed_requests_row_goes_to_the_next_and_a_preempted_one_has_none():
    manager = BlockManager(num_blocks=8, block_size=4, max_running=2)
    first, second, third = make_request(0, 5), make_request(1, 5), make_request(2, 5)
    manager.admit(first, [], 5)
    manager.admit(second, [], 5)
    with pytest.raises(RuntimeError, match="rows"):  # more running requests than the scheduler allows
        manager.admit(third, [], 5)
    row = first.table_row
    manager.free(first)
    assert first.table_row == -1
    manager.free(first)  # again, as a request finished while waiting after a preemption: nothing to give
    manager.admit(third, [], 5)
    assert third.table_row == row
    manager.check_integrity([second, third])


def test_the_integrity_check_sees_a_table_that_differs_from_the_lists():
    manager = BlockManager(num_blocks=8, block_size=4)
    first, second = make_request(0, 5), make_request(1, 5)
    manager.admit(first, [], 5)
    manager.admit(second, [], 5)
    manager.table.blocks[first.table_row, 1] += 1
    with pytest.raises(AssertionError, match="differs"):
        manager.check_integrity([first, second])
    manager.table.blocks[first.table_row, 1] -= 1
    second.table_row = first.table_row
    with pytest.raises(AssertionError, match="shared"):
        manager.check_integrity([first, second])


def test_changes_are_logged_once_each_with_their_last_value():
    table = BlockTable(rows=3, width=4, block_size=2)
    table.write(1, 0, [5, 6])
    table.write(2, 2, [7])
    table.write(1, 1, [9])  # the same entry again
    indices, values = table.take_changes()
    assert dict(zip(indices.tolist(), values.tolist(), strict=True)) == {4: 5, 5: 9, 10: 7}
    assert len(indices) == 3
    assert [len(logged) for logged in table.take_changes()] == [0, 0]  # taken
    with pytest.raises(RuntimeError, match="columns"):
        table.write(0, 3, [1, 2])


def test_the_device_copy_follows_the_host_table_and_keeps_its_padding_row():
    table = BlockTable(rows=2, width=3, block_size=4)
    copy = DeviceBlockTable(table, torch.device("cpu"), padding_block=11)
    table.write(0, 0, [4, 2])
    table.write(1, 0, [8])
    copy.sync()
    table.write(1, 1, [3, 1])
    table.write(0, 0, [6])
    copy.sync()
    assert copy.blocks[: copy.padding_start].view(2, 3)[0, :2].tolist() == [6, 2]
    assert copy.blocks[: copy.padding_start].view(2, 3)[1].tolist() == [8, 3, 1]
    assert copy.blocks[copy.padding_start] == 11
    assert copy.starts(np.array([1, 0])).tolist() == [3, 0]


def test_an_eager_steps_decode_splits_come_from_its_own_pages(loaded_fp32, monkeypatch):
    """Triton's grouped decode kernel would choose its splits from the pages it is given, and the engine
    gives it the whole block table: the runner passes the splits of the decodes' own pages (those the
    graphs of the same step take), here 2 for 8 decodes of some 600 keys, not the table's 16."""
    monkeypatch.setattr(model_runner, "triton_attention", SimpleNamespace(takes=lambda layer: True))
    made = []

    def recorded_decodes(*args):
        decodes = InPlaceDecodes(*args)
        made.append((decodes.splits, decodes.lengths.tolist()))
        return decodes

    monkeypatch.setattr(model_runner, "InPlaceDecodes", recorded_decodes)
    engine = Engine(loaded_fp32.adapter, loaded_fp32.processor.tokenizer, EngineConfig(), [])
    sampling = SamplingParams(max_new_tokens=8, ignore_eos=True)
    for i in range(8):
        engine.add_request(EngineRequest(list(range(100 + i, 700 + i)), [], sampling, tag=i))
    while engine.num_unfinished:
        engine.step()
    kv_heads = engine.runner.kv_cache.layers[0].shape[1]
    full_steps = [(splits, lengths) for splits, lengths in made if len(lengths) == 8]
    assert full_steps and all(splits == 2 for splits, _ in full_steps)
    assert all(splits == decode_splits(kv_heads, np.array(lengths), 16) for splits, lengths in made)
    table_pages = engine.runner.block_table.blocks.numel()
    assert split_count(8, kv_heads, table_pages * 16 / 8) == 16  # what the table's size would have given
