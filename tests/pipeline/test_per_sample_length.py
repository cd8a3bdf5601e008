"""`sampling.max_new_tokens_field`: each sample's own token limit, read from an input column."""

import pyarrow as pa
import pyarrow.parquet as pq

from batchvl.config import load_job_config
from batchvl.pipeline.runner import run_job
from tests.conftest import png_bytes, random_image, two_prompt_job_yaml


def test_each_sample_generates_its_own_number_of_tokens(tmp_path, tiny_model_dir, loaded_fp32):
    (tmp_path / "data").mkdir()
    budgets = [3, 9, None, 1, 0]
    images = [png_bytes(random_image(40 + 5 * i, 48, seed=i)) for i in range(len(budgets))]
    keys = [f"k{i}" for i in range(len(budgets))]
    pq.write_table(
        pa.table({"key": keys, "image": images, "budget": budgets}), tmp_path / "data" / "s.parquet"
    )
    (tmp_path / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}", "preprocess: {workers: 0}"))
    cfg = load_job_config(
        tmp_path / "job.yaml", ["sampling.max_new_tokens_field=budget", "sampling.ignore_eos=true"]
    )
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = pq.read_table(tmp_path / "out" / "s.parquet").to_pylist()
    by_key = {}
    for row in rows:
        by_key.setdefault(row["key"], []).append(row)
    for key, budget in zip(keys, budgets, strict=True):
        if budget is None:  # a null cell: the job's own sampling.max_new_tokens (6)
            assert [r["num_output_tokens"] for r in by_key[key]] == [6, 6]
        elif budget:
            assert [r["num_output_tokens"] for r in by_key[key]] == [budget, budget]
            assert {r["finish_reason"] for r in by_key[key]} == {"length"}
        else:  # a non-positive limit is this sample's error, not the job's
            assert {(r["status"], r["error_type"]) for r in by_key[key]} == {("error", "missing_field")}
            assert "'budget' must hold a positive integer" in by_key[key][0]["error_message"]


def test_limits_written_as_floats_with_missing_values_as_pandas_writes_them_are_taken(
    tmp_path, tiny_model_dir, loaded_fp32
):
    (tmp_path / "data").mkdir()
    budgets = [3.0, float("nan"), 2.5]  # an integer column with a missing value, as pandas writes it
    images = [png_bytes(random_image(40 + 5 * i, 48, seed=i)) for i in range(len(budgets))]
    keys = [f"k{i}" for i in range(len(budgets))]
    pq.write_table(
        pa.table({"key": keys, "image": images, "budget": pa.array(budgets, pa.float64())}),
        tmp_path / "data" / "s.parquet",
    )
    (tmp_path / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}", "preprocess: {workers: 0}"))
    cfg = load_job_config(
        tmp_path / "job.yaml", ["sampling.max_new_tokens_field=budget", "sampling.ignore_eos=true"]
    )
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = {}
    for row in pq.read_table(tmp_path / "out" / "s.parquet").to_pylist():
        rows.setdefault(row["key"], []).append(row)
    assert [r["num_output_tokens"] for r in rows["k0"]] == [3, 3]
    assert [r["num_output_tokens"] for r in rows["k1"]] == [6, 6]  # NaN: the job's own max_new_tokens
    assert {(r["status"], r["error_type"]) for r in rows["k2"]} == {("error", "missing_field")}
    assert "'budget' must hold a positive integer, got 2.5" in rows["k2"][0]["error_message"]
