"""Results on an S3-compatible object store (moto's server on 127.0.0.1, written with s3fs): the rows a local
output folder gets, commits without rename (the Parquet object, then a marker naming its size and hash),
a job killed with SIGKILL and rerun, tasks splitting the shards, `status` and `retry-failed` there."""

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchvl.api as batchvl_api
from batchvl.commands.report.page import write_report
from batchvl.config import load_job_config
from batchvl.errors import UserError
from batchvl.outputs.claims import Holder, ShardClaims
from batchvl.outputs.commit import ShardMarker, commit_shard, read_committed, read_marker
from batchvl.pipeline.runner import run_job
from batchvl.pipeline.tasks import TaskSlice
from batchvl.storage.output_dir import open_output_dir
from tests.conftest import output_rows, png_bytes, random_image, two_prompt_job_yaml, write_image_shards
from tests.test_cli import batchvl

SHARD_SIZES = [3, 4, 2, 5, 3, 4]
BAD = (2, 1)  # an undecodable image: error rows
LARGE = (4, 0)  # over the job's max_image_pixels: image_too_large until a retry allows it
BUCKET = "results"


@pytest.fixture(scope="module")
def bucket(s3):
    endpoint, client = s3
    client.create_bucket(Bucket=BUCKET)
    return endpoint, client


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("s3-output")
    write_image_shards(
        root / "data", SHARD_SIZES, {BAD: b"not an image", LARGE: png_bytes(random_image(200, 200, seed=99))}
    )
    # One sequence at a time: shards finish one after another, so a run can be killed between them.
    (root / "job.yaml").write_text(
        two_prompt_job_yaml(
            tiny_model_dir,
            "{max_num_seqs: 1, lookahead: 1}",
            "preprocess: {workers: 1, max_image_pixels: 20000}",
        )
    )
    return root


def s3_settings(endpoint: str, prefix: str) -> list[str]:
    options = f"{{endpoint_url: '{endpoint}', key: testing, secret: testing}}"
    return [f"output.dir=s3://{BUCKET}/{prefix}", f"output.storage_options={options}"]


def config(job_dir, *overrides: str):
    return load_job_config(job_dir / "job.yaml", list(overrides))


def keys_under(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


def s3_rows(client, prefix: str) -> list[dict]:
    """Every row of output shards part-0 .. part-5 under the prefix, in order, without the timing column."""
    rows = []
    for number in range(len(SHARD_SIZES)):
        body = client.get_object(Bucket=BUCKET, Key=f"{prefix}/part-{number}.parquet")["Body"].read()
        rows.extend(pq.read_table(io.BytesIO(body)).drop(["latency_s"]).to_pylist())
    return rows


def done_markers(client, prefix: str) -> list[str]:
    return [key for key in keys_under(client, f"{prefix}/_batchvl/done/") if key.endswith(".json")]


@pytest.fixture(scope="module")
def reference(job_dir, loaded_fp32):
    run_job(config(job_dir, "output.dir=reference"), loaded=loaded_fp32, show_progress=False)
    rows = output_rows(job_dir / "reference", len(SHARD_SIZES))
    errors = sorted(r["error_type"] for r in rows if r["status"] == "error")
    assert errors == ["image_decode_error"] * 2 + ["image_too_large"] * 2
    return rows


def test_a_job_writes_to_s3_the_rows_it_writes_locally_and_a_rerun_skips_them(
    job_dir, bucket, reference, loaded_fp32
):
    endpoint, client = bucket
    settings = [*s3_settings(endpoint, "plain"), "output.format=openai_batch"]
    cfg = config(job_dir, *settings)
    results = batchvl_api.run(cfg, model=loaded_fp32, progress=False)  # the notebook API, rows read back
    assert results.stats["shards_committed"] == len(SHARD_SIZES)
    assert s3_rows(client, "plain") == reference
    read_back = results.dataset.remove_columns(["shard", "latency_s"]).to_list()
    assert read_back == reference
    # each marker names the size and SHA-256 of the object beside it
    for number in range(len(SHARD_SIZES)):
        body = client.get_object(Bucket=BUCKET, Key=f"plain/part-{number}.parquet")["Body"].read()
        marker = json.loads(
            client.get_object(Bucket=BUCKET, Key=f"plain/_batchvl/done/part-{number}.json")["Body"].read()
        )
        assert (marker["output_bytes"], marker["output_sha256"]) == (
            len(body),
            hashlib.sha256(body).hexdigest(),
        )
        lines = client.get_object(Bucket=BUCKET, Key=f"plain/part-{number}.output.jsonl")["Body"].read()
        assert len(lines.decode().splitlines()) == 2 * SHARD_SIZES[number]
    written = keys_under(client, "plain/")
    assert not [key for key in written if "/_batchvl/claims/" in key or ".tmp" in key or "write-check" in key]
    assert len([key for key in written if "/_batchvl/stats/run-" in key]) == 1

    again = run_job(cfg, loaded=loaded_fp32, show_progress=False)
    assert again.stats["shards_skipped"] == len(SHARD_SIZES) and again.stats["samples"] == 0
    status = batchvl("status", "job.yaml", *sum((["--set", s] for s in settings), []), cwd=job_dir)
    assert status.returncode == 0, status.stderr
    assert f"shards: {len(SHARD_SIZES)} of {len(SHARD_SIZES)} done" in status.stdout
    assert "complete: every shard is committed" in status.stdout
    assert "output: s3://results/plain" in status.stdout
    target, report = write_report(cfg, samples=4)
    assert target == f"s3://{BUCKET}/plain/report.html" and report.rows == 2 * sum(SHARD_SIZES)
    page = client.get_object(Bucket=BUCKET, Key="plain/report.html")["Body"].read().decode()
    assert page == report.html and "batchvl report: plain" in page


def test_kill_9_in_the_middle_then_rerun_writes_every_row_once(job_dir, bucket, reference):
    endpoint, client = bucket
    settings = sum((["--set", s] for s in s3_settings(endpoint, "killed")), [])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "batchvl", "run", "job.yaml", "--no-progress", *settings]
    process = subprocess.Popen(command, cwd=job_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 180
    while not done_markers(client, "killed"):
        assert process.poll() is None, process.stderr.read().decode()
        assert time.monotonic() < deadline, "no shard was committed in time"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    done_at_kill = done_markers(client, "killed")
    assert 0 < len(done_at_kill) < len(SHARD_SIZES), "the kill should land in the middle of the run"
    claims_left = keys_under(client, "killed/_batchvl/claims/")
    assert claims_left, "the killed run held a claim on the shard it was writing"

    rerun = batchvl("run", "job.yaml", "--no-progress", *settings, cwd=job_dir)
    assert rerun.returncode == 0, rerun.stderr
    assert f"{len(done_at_kill)} already done" in rerun.stdout
    rows = s3_rows(client, "killed")
    assert rows == reference  # every row once, in order: nothing lost, nothing twice
    # the dead run's claims on unfinished shards were taken over and released; one on a shard it committed
    # just before the kill may stay (a committed shard is never claimed again)
    left = [
        key.rsplit("/", 1)[1].removesuffix(".parquet.lock")
        for key in keys_under(client, "killed/_batchvl/claims/")
    ]
    done = [key.rsplit("/", 1)[1].removesuffix(".json") for key in done_at_kill]
    assert set(left) <= set(done)


def test_tasks_split_the_shards_and_retry_failed_fixes_rows_on_s3(job_dir, bucket, reference, loaded_fp32):
    endpoint, client = bucket
    # the job file names the bucket (retry-failed takes the job's own output.dir, never a --set one)
    options = f"{{endpoint_url: '{endpoint}', key: testing, secret: testing}}"
    output = f"output: {{dir: 's3://{BUCKET}/split', storage_options: {options}}}"
    (job_dir / "split.yaml").write_text(
        (job_dir / "job.yaml").read_text().replace("output: {dir: out}", output)
    )
    for index in range(2):
        cfg = load_job_config(job_dir / "split.yaml")
        run_job(cfg, loaded=loaded_fp32, show_progress=False, task=TaskSlice(index, 2))
    assert s3_rows(client, "split") == reference
    out = open_output_dir(
        f"s3://{BUCKET}/split", {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    )
    tasks = sorted(read_marker(out, f"part-{n}.parquet").task for n in range(len(SHARD_SIZES)))
    assert tasks == ["0/2"] * 3 + ["1/2"] * 3
    status = batchvl("status", "split.yaml", cwd=job_dir)
    assert status.returncode == 0 and "complete: every shard is committed" in status.stdout
    assert "rows: 38 ok, 4 error (" in status.stdout
    assert "image_decode_error 2" in status.stdout and "image_too_large 2" in status.stdout

    retried = batchvl(
        "retry-failed",
        "split.yaml",
        "--no-progress",
        "--set",
        "preprocess.max_image_pixels=100000",
        cwd=job_dir,
    )
    assert retried.returncode == 0, retried.stderr
    after = s3_rows(client, "split")
    large_key = f"s{LARGE[0]}-{LARGE[1]}"
    changed = [(a["key"], a["prompt"]) for a, b in zip(after, reference, strict=True) if a != b]
    assert sorted(changed) == [(large_key, "caption"), (large_key, "short")]
    assert all(r["status"] == "ok" for r in after if r["key"] == large_key)
    marker = read_marker(out, f"part-{LARGE[0]}.parquet")
    assert (marker.ok, marker.errors, len(marker.retries)) == (2 * SHARD_SIZES[4], 0, 1)
    status = batchvl("status", "split.yaml", cwd=job_dir)
    assert "rows: 40 ok, 2 error (image_decode_error 2)" in status.stdout


def test_a_shard_is_committed_only_by_a_marker_naming_its_file(bucket):
    endpoint, client = bucket
    out = open_output_dir(
        f"s3://{BUCKET}/protocol", {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    )
    table = pa.table({"key": ["a", "b"], "text": ["one", "two"]})
    marker = ShardMarker("s.parquet", "f", {}, rows=2, ok=2, errors=0, errors_by_type={}, task=None)
    commit_shard(out, "s.parquet", table, marker)
    assert read_committed(out, "s.parquet", read_marker(out, "s.parquet")) == table
    # a file written without its marker (a run killed between the two) is not committed, and is overwritten
    client.delete_object(Bucket=BUCKET, Key="protocol/_batchvl/done/s.json")
    assert read_marker(out, "s.parquet") is None
    commit_shard(out, "s.parquet", table, marker)
    assert read_marker(out, "s.parquet") is not None
    # a file of another size than its marker names (rewritten after the commit) is not committed
    original = client.get_object(Bucket=BUCKET, Key="protocol/s.parquet")["Body"].read()
    client.put_object(Bucket=BUCKET, Key="protocol/s.parquet", Body=original + b"\0")
    assert read_marker(out, "s.parquet") is None
    # one of the same size but other bytes is committed as far as sizes tell, and refused when read
    tampered = bytearray(original)
    tampered[len(tampered) // 2] ^= 0xFF
    client.put_object(Bucket=BUCKET, Key="protocol/s.parquet", Body=bytes(tampered))
    with pytest.raises(UserError, match="changed after it was committed"):
        read_committed(out, "s.parquet", read_marker(out, "s.parquet"))


def test_claims_on_s3_are_exclusive_and_a_dead_holders_claim_is_taken_over(bucket):
    endpoint, _ = bucket
    out = open_output_dir(
        f"s3://{BUCKET}/claims", {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    )
    ours = ShardClaims(out, Holder.of_process(os.getpid()))
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as sleeper:
        theirs = ShardClaims(out, Holder.of_process(sleeper.pid))
        assert ours.acquire("a.parquet") is None
        assert theirs.acquire("a.parquet") == ours.holder  # a conditional PUT: the second create fails
        ours.release("a.parquet")
        assert theirs.acquire("a.parquet") is None
        sleeper.kill()
    assert ours.acquire("a.parquet") is None  # its holder is gone: taken over
    assert json.loads(out.read_text(ours.path("a.parquet")))["pid"] == os.getpid()


def test_an_output_bucket_that_cannot_be_written_exits_2_before_any_work(bucket, tmp_path, tiny_model_dir):
    endpoint, _ = bucket
    (tmp_path / "data").mkdir()
    pq.write_table(
        pa.table({"key": ["a"], "image": [png_bytes(random_image(40, 40, seed=1))]}),
        tmp_path / "data" / "a.parquet",
    )
    (tmp_path / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}"))
    options = f"output.storage_options={{endpoint_url: '{endpoint}', key: testing, secret: testing}}"
    done = batchvl(
        "run", "job.yaml", "--set", "output.dir=s3://missing-bucket/out", "--set", options, cwd=tmp_path
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "output.dir s3://missing-bucket/out cannot be written" in line and "storage_options" in line


def test_slurm_keeps_script_and_logs_local_and_status_finds_the_array_on_s3(bucket, tmp_path, tiny_model_dir):
    endpoint, _ = bucket
    write_image_shards(tmp_path / "data", [2, 2, 2])
    options = f"{{endpoint_url: '{endpoint}', key: testing, secret: testing}}"
    output = f"output: {{dir: 's3://{BUCKET}/array', storage_options: {options}}}"
    (tmp_path / "job.yaml").write_text(
        two_prompt_job_yaml(tiny_model_dir, "{}").replace("output: {dir: out}", output)
    )
    written = batchvl("slurm", "job.yaml", "--array", "3", cwd=tmp_path)
    assert written.returncode == 0, written.stderr
    script = tmp_path / "batchvl-slurm" / "array" / "_batchvl" / "slurm" / "array.sbatch"
    assert f"wrote {script}" in written.stdout
    assert f"#SBATCH --output={script.parent.parent / 'logs' / 'task-%a.log'}" in script.read_text()
    status = batchvl("status", "job.yaml", cwd=tmp_path)
    assert status.returncode == 0, status.stderr
    assert f"rerun missing tasks: sbatch --array=0-2 {script}" in status.stdout


def test_caption_refuses_an_object_store_output_dir_before_any_work(tiny_model_dir):
    import datasets

    from batchvl.api import caption

    dataset = datasets.Dataset.from_dict({"image": [png_bytes(random_image(40, 40, seed=2))]})
    with pytest.raises(UserError, match="caption\\(\\) keeps a copy of the dataset in output_dir"):
        caption(dataset, model=tiny_model_dir, output_dir="s3://results/notebook")
