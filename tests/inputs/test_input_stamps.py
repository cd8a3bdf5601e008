"""A committed shard records the input file it was made from: replaced under the same name (other images,
more rows), the shard is run again whole, never kept in part, and `status` says so rather than
'complete'. Real jobs on the tiny model."""

import fsspec
import pytest

from batchvl.commands.labels import job_rows
from batchvl.commands.status import format_status, job_status
from batchvl.config import load_job_config
from batchvl.errors import UserError
from batchvl.inputs.stamps import input_stamp
from batchvl.outputs.commit import read_input_stamp
from batchvl.pipeline.runner import run_job
from batchvl.storage.output_dir import LocalDir
from tests.conftest import caption_job_yaml, output_rows, png_bytes, random_image, write_image_shards

CAPTION = "{name: caption, text: Describe this image.}"
SHORT = "{name: short, text: One word.}"


@pytest.fixture
def job_dir(tmp_path, tiny_model_dir):
    write_image_shards(tmp_path / "data", [2, 3])
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tiny_model_dir))
    return tmp_path


def config(job_dir, out: str, *overrides: str):
    return load_job_config(job_dir / "job.yaml", [f"output.dir={out}", *overrides])


def replace_first_shard(job_dir) -> None:
    """part-0.parquet written again: other images under the same keys, and two more samples."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = [png_bytes(random_image(50 + 5 * i, 70, seed=100 + i)) for i in range(4)]
    keys = [f"s0-{i}" for i in range(4)]
    pq.write_table(pa.table({"key": keys, "image": images}), job_dir / "data" / "part-0.parquet")


def test_a_replaced_input_file_is_run_again_whole_with_an_added_prompt(job_dir, loaded_fp32):
    run_job(config(job_dir, "out"), loaded=loaded_fp32, show_progress=False)
    replace_first_shard(job_dir)
    added = f"prompts=[{CAPTION}, {SHORT}]"
    status = job_status(config(job_dir, "out", added))
    assert status.shards_done == 0 and status.missing_tasks == [0]  # part-1 is run for its new prompt
    text = format_status(status, "job.yaml")
    assert "1 shard(s) were committed from input files that changed since" in text
    assert "complete" not in text
    assert "short: 3 row(s) reused" not in text and "caption: 3 row(s) reused, 4 to compute" in text
    with pytest.raises(UserError, match=r"1 shard\(s\) committed from input files that changed since"):
        job_rows(config(job_dir, "out"))  # a reader does not hand out the replaced file's rows
    rerun = run_job(config(job_dir, "out", added), loaded=loaded_fp32, show_progress=False)
    assert rerun.stats["shards_committed"] == 2
    run_job(config(job_dir, "fresh", added), loaded=loaded_fp32, show_progress=False)
    rows = output_rows(job_dir / "out", 2)
    assert len(rows) == 2 * (4 + 3)
    assert rows == output_rows(job_dir / "fresh", 2)
    stamp = read_input_stamp(LocalDir(str(job_dir / "out")), "part-0.parquet")
    assert stamp == input_stamp(str(job_dir / "data" / "part-0.parquet"), {})
    again = run_job(config(job_dir, "out", added), loaded=loaded_fp32, show_progress=False)
    assert again.stats["shards_skipped"] == 2  # the new file's stamp recorded: done


def test_an_object_replaced_in_a_store_has_another_stamp():
    fs = fsspec.filesystem("memory")
    fs.pipe("/stamps/part-0.parquet", b"one")
    before = input_stamp("memory://stamps/part-0.parquet", {})
    assert input_stamp("memory://stamps/part-0.parquet", {}) == before
    fs.pipe("/stamps/part-0.parquet", b"two")
    assert input_stamp("memory://stamps/part-0.parquet", {}) != before
