"""`batchvl retry-failed`: only error rows are rerun, with overrides, and merged back into their shards."""

import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.commands.retry import retry_failed
from batchvl.config import checkpoint, load_job_config
from batchvl.errors import UserError
from batchvl.inputs import stamps
from batchvl.outputs.commit import read_input_stamp, read_marker
from batchvl.outputs.writers import output_path
from batchvl.pipeline.runner import run_job
from batchvl.storage.output_dir import LocalDir
from tests.conftest import output_rows, png_bytes, random_image, two_prompt_job_yaml
from tests.test_cli import batchvl

# per shard: image sizes; (120, 120) is over the job's max_image_pixels of 5000, None is not an image
SHARDS = [[(40, 50), (120, 120), (45, 60)], [(40, 40), (50, 40)], [None, (120, 120), (50, 50), (110, 100)]]
LARGE = "preprocess.max_image_pixels=100000"


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("retry")
    (root / "data").mkdir()
    for number, sizes in enumerate(SHARDS):
        images = [
            png_bytes(random_image(*size, seed=number * 10 + i)) if size else b"junk"
            for i, size in enumerate(sizes)
        ]
        keys = [f"k{number}-{i}" for i in range(len(sizes))]
        pq.write_table(pa.table({"key": keys, "image": images}), root / "data" / f"part-{number}.parquet")
    (root / "job.yaml").write_text(
        two_prompt_job_yaml(tiny_model_dir, "{}", "preprocess: {workers: 1, max_image_pixels: 5000}")
    )
    return root


def rows_of(out_dir) -> list[dict]:
    return output_rows(out_dir, len(SHARDS))


def test_retry_reruns_only_error_rows_and_merges_them_in_order(job_dir, loaded_fp32):
    job = load_job_config(job_dir / "job.yaml")
    run_job(job, loaded=loaded_fp32, show_progress=False)
    before = rows_of(job_dir / "out")
    assert sorted(r["error_type"] for r in before if r["status"] == "error") == (
        ["image_decode_error"] * 2 + ["image_too_large"] * 6
    )
    untouched = os.stat(
        output_path(LocalDir(str(job_dir / "out")), "part-1.parquet")
    ).st_mtime_ns  # no errors there
    metadata = pq.read_schema(output_path(LocalDir(str(job_dir / "out")), "part-0.parquet")).metadata

    summary = retry_failed(
        job, load_job_config(job_dir / "job.yaml", [LARGE]), [LARGE], loaded=loaded_fp32, show_progress=False
    )
    assert (summary.stats["requests"], summary.stats["ok"], summary.stats["errors"]) == (8, 6, 2)
    assert summary.stats["shards_committed"] == 2

    # The same rows as a job run with the larger limit from the start; kept rows are untouched.
    reference = job_dir / "reference"
    run_job(
        load_job_config(job_dir / "job.yaml", [LARGE, f"output.dir={reference}"]),
        loaded=loaded_fp32,
        show_progress=False,
    )
    after = rows_of(job_dir / "out")
    assert after == rows_of(reference)
    assert [r for r in after if r["status"] == "ok" and r in before] == [
        r for r in before if r["status"] == "ok"
    ]
    assert os.stat(output_path(LocalDir(str(job_dir / "out")), "part-1.parquet")).st_mtime_ns == untouched
    assert pq.read_schema(output_path(LocalDir(str(job_dir / "out")), "part-0.parquet")).metadata == metadata

    marker = read_marker(LocalDir(str(job_dir / "out")), "part-2.parquet")
    assert (marker.rows, marker.ok, marker.errors, marker.errors_by_type) == (
        8,
        6,
        2,
        {"image_decode_error": 2},
    )
    assert marker.retries[0]["overrides"] == [LARGE] and marker.retries[0]["rows_fixed"] == 4
    # The job is still complete for `batchvl run` (the markers keep the job's own config).
    rerun = run_job(job, loaded=loaded_fp32, show_progress=False)
    assert rerun.stats["shards_skipped"] == 3 and rerun.stats["shards_committed"] == 0

    # From the command line, without overrides: only the two rows that still fail are retried.
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "batchvl", "retry-failed", "job.yaml", "--no-progress"],
        cwd=job_dir,
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "retried 2 error row(s) in 1 shard(s): 0 ok now, 2 still errors" in result.stdout
    assert rows_of(job_dir / "out") == after
    assert len(read_marker(LocalDir(str(job_dir / "out")), "part-2.parquet").retries) == 2


def test_retry_may_not_change_prompts_or_inputs(job_dir):
    job = load_job_config(job_dir / "job.yaml")
    for override, key in (
        ("prompts=[{name: x, text: y}]", "prompts"),
        ("input.key_column=image", "input.key_column"),
    ):
        with pytest.raises(UserError, match=f"may not change {key}"):
            retry_failed(job, load_job_config(job_dir / "job.yaml", [override]), [override])


def test_a_retried_follow_up_uses_its_inputs_committed_rows_and_no_ok_row_changes(tmp_path, tiny_model_dir):
    """`attrs` inserts `{caption}` and fails on its own (too few tokens for its JSON); the retry, with more
    tokens, runs `attrs` only, on the committed captions. One image is gone by then: its `attrs` fails
    again, as file_not_found, and its ok caption stays."""
    (tmp_path / "data").mkdir()
    paths = []
    for i in range(4):
        paths.append(tmp_path / "data" / f"{i}.png")
        paths[-1].write_bytes(png_bytes(random_image(40 + 8 * i, 48, seed=70 + i)))
    keys = [f"k{i}" for i in range(4)]
    table = pa.table({"key": keys, "image": [p.name for p in paths]})
    pq.write_table(table, tmp_path / "data" / "part-0.parquet")
    schema = "{type: object, properties: {n: {type: integer, minimum: 0, maximum: 9}}, required: [n]}"
    (tmp_path / "job.yaml").write_text(f"""
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts:
  - {{name: caption, text: "Describe this image."}}
  - {{name: attrs, text: "Attributes of {{caption}} as JSON.", json_schema: {schema}}}
sampling: {{max_new_tokens: 3}}
preprocess: {{workers: 0}}
output: {{dir: out}}
""")
    assert batchvl("run", "job.yaml", "--no-progress", cwd=tmp_path).returncode == 0
    before = rows_of_shard(tmp_path / "out")
    assert [(r["prompt"], r["status"], r["error_type"]) for r in before] == [
        ("caption", "ok", None),
        ("attrs", "error", "incomplete_output"),
    ] * 4
    paths[2].unlink()  # moved away after the run

    result = batchvl(
        "retry-failed", "job.yaml", "--set", "sampling.max_new_tokens=60", "--no-progress", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    after = rows_of_shard(tmp_path / "out")
    retried = [(r["key"], r["status"], r["error_type"]) for r in after if r["prompt"] == "attrs"]
    assert retried == [
        ("k0", "ok", None),
        ("k1", "ok", None),
        ("k2", "error", "file_not_found"),
        ("k3", "ok", None),
    ]
    assert "retried 4 error row(s) in 1 shard(s): 3 ok now, 1 still errors" in result.stdout
    ok_before = [r for r in before if r["status"] == "ok"]
    assert [r for r in after if r["prompt"] == "caption"] == ok_before  # every column, latency too
    # Each retried prompt is the first run's (the same committed caption inserted), so its token count is.
    for old, new in zip(before[1::2], after[1::2], strict=True):
        if new["status"] == "ok":
            assert new["num_prompt_tokens"] == old["num_prompt_tokens"]


def rows_of_shard(out_dir) -> list[dict]:
    return pq.read_table(output_path(LocalDir(str(out_dir)), "part-0.parquet")).to_pylist()


def test_a_retry_reads_no_inputs_digest_and_keeps_the_recorded_stamp(
    tmp_path, tiny_model_dir, loaded_fp32, monkeypatch
):
    """A retry's commit keeps the input's stamp on record (it retries only shards whose input is unchanged):
    a run reads each shard's file once more for its digest, which a retry would read for nothing."""
    monkeypatch.setattr(checkpoint, "RACY_S", 0.0)  # stamps trusted at once: the plan reads no file either
    (tmp_path / "data").mkdir()
    images = [png_bytes(random_image(40, 50, seed=1)), b"junk"]
    pq.write_table(pa.table({"key": ["a", "b"], "image": images}), tmp_path / "data" / "part-0.parquet")
    (tmp_path / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}", "preprocess: {workers: 0}"))
    job = load_job_config(tmp_path / "job.yaml")
    run_job(job, loaded=loaded_fp32, show_progress=False)
    out = LocalDir(str(tmp_path / "out"))
    recorded = read_input_stamp(out, "part-0.parquet")
    assert "xxh3" in recorded

    reads = []
    monkeypatch.setattr(stamps, "file_digest", reads.append)
    summary = retry_failed(job, job, [], loaded=loaded_fp32, show_progress=False)
    assert (summary.stats["requests"], summary.stats["shards_committed"]) == (2, 1)  # the junk's two rows
    assert reads == []
    assert read_input_stamp(out, "part-0.parquet") == recorded
