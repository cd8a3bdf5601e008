"""Input shards on an S3-compatible object store (moto's server on 127.0.0.1, read with s3fs): the same
rows as the same files read locally, shard names relative to the pattern, split across tasks, with
credentials from the job or from the environment."""

import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import png_bytes, random_image
from tests.test_cli import batchvl

IMAGES = [png_bytes(random_image(40 + 4 * i, 56, 60 + i)) for i in range(5)]


def parquet_bytes(keys: list[str], images: list[bytes]) -> bytes:
    buffer = io.BytesIO()
    pq.write_table(pa.table({"key": keys, "image": images}), buffer)
    return buffer.getvalue()


def tar_bytes(members: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


FILES = {
    "parquet": {
        "a.parquet": parquet_bytes(["a0", "a1"], IMAGES[:2]),
        "more/b.parquet": parquet_bytes(["b0", "b1", "b2"], IMAGES[2:]),
    },
    "webdataset": {"s-0.tar": tar_bytes({"x.png": IMAGES[0], "y.png": IMAGES[1]})},
}


def job_yaml(model_dir, input_paths: str, fmt: str, storage: str = "") -> str:
    return f"""
model: {{path: {model_dir}, dtype: float32, device: cpu}}
input: {{format: {fmt}, paths: ["{input_paths}"], key_column: key{storage}}}
prompts: [{{name: caption, text: Describe this image.}}]
sampling: {{max_new_tokens: 4}}
output: {{dir: out}}
"""


def texts(out_dir) -> dict[tuple[str, str], str]:
    found = {}
    for path in sorted(out_dir.rglob("*.parquet")):
        for row in pq.read_table(path).to_pylist():
            assert row["status"] == "ok", row["error_message"]
            found[(str(path.relative_to(out_dir)), row["key"])] = row["text"]
    return found


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_shards_on_s3_give_the_rows_of_the_same_files_read_locally(s3, tmp_path, tiny_model_dir, fmt):
    endpoint, client = s3
    for name, data in FILES[fmt].items():
        client.put_object(Bucket="data", Key=f"{fmt}/{name}", Body=data)
        (tmp_path / "local" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "local" / name).write_bytes(data)
    pattern = "**/*.parquet" if fmt == "parquet" else "*.tar"
    options = f', storage_options: {{endpoint_url: "{endpoint}", key: testing, secret: testing}}'
    remote, local = tmp_path / "remote", tmp_path / "local-run"
    for folder, paths, storage in (
        (remote, f"s3://data/{fmt}/{pattern}", options),
        (local, f"{tmp_path}/local/{pattern}", ""),
    ):
        folder.mkdir()
        (folder / "job.yaml").write_text(job_yaml(tiny_model_dir, paths, fmt, storage))
        done = batchvl("run", "job.yaml", cwd=folder)
        assert done.returncode == 0, done.stderr
    from_s3 = texts(remote / "out")
    assert from_s3 == texts(local / "out")
    expected_files = {"a.parquet", "more/b.parquet"} if fmt == "parquet" else {"s-0.parquet"}
    assert {name for name, _ in from_s3} == expected_files
    status = batchvl("status", "job.yaml", cwd=remote)
    assert status.returncode == 0 and "committed" in status.stdout


def test_credentials_from_the_environment_and_tasks_that_split_the_shards(s3, tmp_path, tiny_model_dir):
    endpoint, client = s3
    for name, data in FILES["parquet"].items():
        client.put_object(Bucket="data", Key=f"split/{name}", Body=data)
    (tmp_path / "job.yaml").write_text(job_yaml(tiny_model_dir, "s3://data/split/**/*.parquet", "parquet"))
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_ENDPOINT_URL": endpoint}
    for task in ("0/2", "1/2"):
        done = batchvl("run", "job.yaml", "--shard", task, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
    rows = texts(tmp_path / "out")
    assert sorted(key for _, key in rows) == ["a0", "a1", "b0", "b1", "b2"]
    markers = sorted(p.name for p in (tmp_path / "out" / "_batchvl" / "done").rglob("*.json"))
    assert markers == ["a.json", "b.json"]
    tasks = {
        json.loads(p.read_text())["task"] for p in (tmp_path / "out" / "_batchvl" / "done").rglob("*.json")
    }
    assert tasks == {"0/2", "1/2"}


@pytest.mark.parametrize(
    ("paths", "output", "words"),
    [
        ("s3://data/nothing/*.parquet", "out", "no Parquet files match 's3://data/nothing/*.parquet'"),
        (
            "s3://data/parquet/*.parquet",
            "s3://no-such-bucket/results",
            "output.dir s3://no-such-bucket/results",
        ),
    ],
)
def test_object_store_mistakes_exit_2_with_one_line(s3, tmp_path, tiny_model_dir, paths, output, words):
    endpoint, _ = s3
    options = f', storage_options: {{endpoint_url: "{endpoint}", key: testing, secret: testing}}'
    (tmp_path / "job.yaml").write_text(
        job_yaml(tiny_model_dir, paths, "parquet", options).replace("dir: out", f"dir: {output}")
    )
    done = batchvl("run", "job.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert words in done.stderr


def test_credentials_are_not_written_into_the_outputs(s3, tmp_path, tiny_model_dir):
    endpoint, client = s3
    client.put_object(Bucket="data", Key="secret/a.parquet", Body=FILES["parquet"]["a.parquet"])
    options = f', storage_options: {{endpoint_url: "{endpoint}", key: testing, secret: s3cr3t-value}}'
    (tmp_path / "job.yaml").write_text(
        job_yaml(tiny_model_dir, "s3://data/secret/*.parquet", "parquet", options)
    )
    env = {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value", "AWS_ACCESS_KEY_ID": "testing"}
    assert batchvl("run", "job.yaml", cwd=tmp_path, env=env).returncode == 0
    written = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert any(p.suffix == ".parquet" for p in written)
    assert not [p for p in written if b"s3cr3t-value" in p.read_bytes()]
    recorded = json.loads(pq.read_schema(tmp_path / "out" / "a.parquet").metadata[b"job_config"])
    assert recorded["input"]["storage_options"]["secret"] == "<not recorded>"


def test_media_cells_may_be_object_store_urls(s3, tmp_path, tiny_model_dir):
    endpoint, client = s3
    client.put_object(Bucket="data", Key="media/good.png", Body=IMAGES[0])
    client.put_object(Bucket="data", Key="media/big.png", Body=IMAGES[1] + b"\0" * 4096)
    keys = ["bytes", "url", "missing", "big", "local"]
    cells = [
        IMAGES[0],
        "s3://data/media/good.png",
        "s3://data/media/absent.png",
        "s3://data/media/big.png",
        "local:///etc/hostname",  # another fsspec protocol reaches local files: refused
    ]
    (tmp_path / "data").mkdir()
    rows = [
        {
            "key": k,
            "image": {"bytes": c, "path": None} if isinstance(c, bytes) else {"bytes": None, "path": c},
        }
        for k, c in zip(keys, cells, strict=True)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / "urls.parquet")
    options = f', storage_options: {{endpoint_url: "{endpoint}", key: testing, secret: testing}}'
    limit = len(IMAGES[1]) + 1024  # big.png is over it
    (tmp_path / "job.yaml").write_text(
        job_yaml(tiny_model_dir, f"{tmp_path}/data/*.parquet", "parquet", options).replace(
            "key_column: key", f"key_column: key, download: {{max_bytes: {limit}}}"
        )
    )
    done = batchvl("run", "job.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = {row["key"]: row for row in pq.read_table(tmp_path / "out" / "urls.parquet").to_pylist()}
    assert got["url"]["status"] == "ok" and got["url"]["text"] == got["bytes"]["text"]
    assert (got["missing"]["error_type"], got["big"]["error_type"]) == ("file_not_found", "image_too_large")
    assert "s3://data/media/absent.png" in got["missing"]["error_message"]
    assert got["local"]["error_type"] == "url_not_allowed"


def test_storage_options_a_filesystem_does_not_take_are_one_line_exit_2_from_validate_and_run(
    s3, tmp_path, tiny_model_dir
):
    endpoint, _ = s3
    options = (
        f', storage_options: {{endpoint: "{endpoint}", key: testing, secret: testing}}'  # not endpoint_url
    )
    (tmp_path / "job.yaml").write_text(
        job_yaml(tiny_model_dir, "s3://data/parquet/*.parquet", "parquet", options)
    )
    for command in ("validate", "run"):
        done = batchvl(command, "job.yaml", cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.strip().splitlines()
        assert line.startswith("error: input.storage_options do not suit s3:// (")
        assert "'endpoint'" in line and line.endswith("did you mean 'endpoint_url'?")
    assert not (tmp_path / "out").exists()


def test_an_object_store_media_cell_with_options_the_store_does_not_take_is_an_error_row_naming_the_fix(s3):
    from batchvl.config import DownloadConfig
    from batchvl.errors import SampleError
    from batchvl.inputs.download import Downloader, DownloadStats

    endpoint, client = s3
    client.put_object(Bucket="data", Key="media/typo.png", Body=IMAGES[0])
    downloader = Downloader(
        DownloadConfig(retries=0), {"endpoint": endpoint, "key": "testing", "secret": "testing"}
    )
    with pytest.raises(SampleError) as failed:
        downloader.fetch("s3://data/media/typo.png", DownloadStats())
    assert failed.value.error_type == "download_error"
    assert failed.value.message.startswith(
        "s3://data/media/typo.png: input.storage_options do not suit s3:// ("
    )
    assert failed.value.message.endswith("did you mean 'endpoint_url'?")
