"""A crash at any step of committing again a shard that keeps its unchanged prompts' rows leaves the old
shard or the new one, whole, never a mix, never a row twice; the next run ends with the new one. On a
local folder and on S3 (moto's server). A crash is `Crash` raised in place of one write, as in
test_commit_crash_windows.py."""

import json
from dataclasses import replace

import pytest

from batchvl.config import job_config_from_dict, output_definition
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.batch_output import batch_output_path
from batchvl.outputs.commit import marker_path, read_committed, read_marker
from batchvl.outputs.writers import ResultRow, output_path
from batchvl.pipeline.commit_strategies import WriteShard
from batchvl.pipeline.plan import finish_rewrites
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.resume import plan_shards
from tests.outputs.test_commit_crash_windows import Crash, out, result_row  # noqa: F401 (out: the fixture)

SHARD = ShardInfo("part-0.parquet", "/input/part-0.parquet", 2)
# The writes of a commit over a committed shard, in order: the new marker holding the one it replaces,
# the Parquet file, the batch API file, the marker without what it replaced.
STEPS = ["marker naming the old", "output", "companion", "marker"]


def job(short_text: str):
    return job_config_from_dict(
        {
            "model": {"path": "models/tiny"},
            "input": {"paths": ["data/*.parquet"]},
            "prompts": [{"name": "caption", "text": "Describe."}, {"name": "short", "text": short_text}],
            "output": {"dir": "out", "format": "openai_batch"},
        },
        "/",
    )


OLD, NEW = job("One word."), job("Two words.")


def row(index: int, prompt: str, text: str) -> ResultRow:
    order = ["caption", "short"].index(prompt)
    return replace(result_row(index, text), prompt=prompt, prompt_index=order, latency_s=0.1 + index)


def writer(folder, cfg, kept=None) -> WriteShard:
    return WriteShard(cfg, folder, None, *output_definition(cfg), kept)


def committed_rows(folder) -> list[dict]:
    return read_committed(folder, SHARD.shard, read_marker(folder, SHARD.shard)).to_pylist()


def plan(folder, cfg, record: bool = False):
    defining, fingerprint = output_definition(cfg)
    resume = plan_shards(folder, [SHARD], defining, fingerprint, False, record, PromptGraph.of(cfg.prompts))
    if record:
        finish_rewrites(cfg, folder, resume)
    return resume


def recommit(folder) -> None:
    """The new short rows, with the committed captions kept."""
    writer(folder, NEW, {SHARD.shard: frozenset({"caption"})})(
        SHARD, [row(0, "short", "b"), row(1, "short", "c")]
    )


@pytest.fixture
def old_shard(out):  # noqa: F811 (the fixture imported above)
    rows = [
        row(0, "caption", "a cat"),
        row(0, "short", "cat"),
        row(1, "caption", "a dog"),
        row(1, "short", "dog"),
    ]
    writer(out, OLD)(SHARD, rows)
    return committed_rows(out)


def new_rows(old: list[dict]) -> list[dict]:
    expected = [dict(r) for r in old]
    expected[1]["text"], expected[3]["text"] = "b", "c"
    for r in expected[1::2]:
        r["latency_s"] = 0.1 + r["sample_index"]
    return expected


def test_a_recommit_writes_the_steps_this_file_crashes_at(out, old_shard):  # noqa: F811
    where = {
        output_path(out, SHARD.shard): "output",
        batch_output_path(out, SHARD.shard): "companion",
        marker_path(out, SHARD.shard): "marker",
    }
    writes = []
    write = out.write_bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            out, "write_bytes", lambda location, data: (writes.append(where[location]), write(location, data))
        )
        recommit(out)
    assert writes == ["marker", "output", "companion", "marker"]
    assert committed_rows(out) == new_rows(old_shard)


@pytest.mark.parametrize("step", range(len(STEPS)), ids=STEPS)
def test_a_crash_at_any_step_leaves_the_old_shard_or_the_new_one_and_a_rerun_ends_with_the_new(
    out,  # noqa: F811
    old_shard,
    step,
):
    write, calls = out.write_bytes, []

    def write_or_crash(location: str, data: bytes) -> None:
        calls.append(location)
        if len(calls) == step + 1:
            raise Crash(STEPS[step])
        write(location, data)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Crash):
        patch.setattr(out, "write_bytes", write_or_crash)
        recommit(out)

    # Old before the new file is written, new from then on: never a mix, every row once.
    expected = old_shard if STEPS[step] in ("marker naming the old", "output") else new_rows(old_shard)
    assert committed_rows(out) == expected
    resume = plan(out, NEW)
    if expected is old_shard:
        assert resume.pending == [SHARD] and resume.reuse[SHARD.shard].run == frozenset({1})
    else:
        assert resume.pending == []  # done: the rerun finishes its last steps

    # The next run: the shard is committed again, or its commit finished.
    if plan(out, NEW, record=True).pending:
        recommit(out)
    assert committed_rows(out) == new_rows(old_shard)
    marker = json.loads(out.read_text(marker_path(out, SHARD.shard)))
    assert "replaces" not in marker and marker["rows"] == 4  # settled
    lines = [json.loads(line) for line in out.read_text(batch_output_path(out, SHARD.shard)).splitlines()]
    assert [line["custom_id"] for line in lines] == ["k0:caption", "k0:short", "k1:caption", "k1:short"]
    assert '"content": "b"' in json.dumps(lines[1])  # the new row's
