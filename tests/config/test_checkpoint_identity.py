"""The checkpoint at `model.path` defines the output with its files: weights, tokenizer and chat template,
processor config changed in place are refused over committed shards as a changed `model.dtype` is
(naming what changed and `--overwrite`), and `--overwrite` gives the rows of a fresh run. Markers from
before the identity was recorded are accepted and get it. Real jobs on a copy of the tiny model."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from batchvl.config import checkpoint as checkpoint_module
from batchvl.config import definition_fingerprint, load_job_config
from batchvl.config.checkpoint import checkpoint_identity
from batchvl.outputs.commit import input_stamp_path, marker_path, read_input_stamp
from batchvl.pipeline.runner import run_job
from batchvl.storage.output_dir import LocalDir
from tests.conftest import caption_job_yaml, output_rows, write_image_shards
from tests.test_cli import batchvl

SHARD_SIZES = [2]
CAPTION = "{name: caption, text: Describe this image.}"
SHORT = "{name: short, text: One word.}"


@pytest.fixture
def job_dir(tmp_path, tiny_model_dir):
    """A job over a copy of the tiny model, which its tests change in place."""
    shutil.copytree(tiny_model_dir, tmp_path / "model")
    write_image_shards(tmp_path / "data", SHARD_SIZES)
    (tmp_path / "job.yaml").write_text(caption_job_yaml(tmp_path / "model"))
    return tmp_path


def config(job_dir, out: str, *overrides: str):
    return load_job_config(job_dir / "job.yaml", [f"output.dir={out}", *overrides])


def new_weights(model) -> None:
    """The same tensors, names and file size, other values: a checkpoint saved again after training."""
    path = model / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(1)
    perturbed = {
        name: t + 0.05 * torch.randn(t.shape, generator=generator).to(t.dtype) if t.is_floating_point() else t
        for name, t in tensors.items()
    }
    size = path.stat().st_size
    save_file(perturbed, path, metadata={"format": "pt"})
    assert path.stat().st_size == size


def new_chat_template(model) -> None:
    path = model / "chat_template.jinja"
    path.write_text(path.read_text().replace("You are a helpful assistant.", "You are a terse assistant."))


def new_image_mean(model) -> None:
    path = model / "processor_config.json"
    processor = json.loads(path.read_text())
    processor["image_processor"]["image_mean"] = [0.5, 0.5, 0.5]
    path.write_text(json.dumps(processor, indent=2))


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (new_weights, "weights or model config at model.path (model.checkpoint.weights)"),
        (new_chat_template, "tokenizer or chat template at model.path (model.checkpoint.tokenizer)"),
        (new_image_mean, "processor config at model.path (model.checkpoint.processor)"),
    ],
)
def test_a_checkpoint_changed_in_place_is_refused_and_overwrite_gives_a_fresh_run(job_dir, change, named):
    run_job(config(job_dir, "out"), show_progress=False)
    change(job_dir / "model")
    # An added prompt would run on the new checkpoint beside the old one's rows: refused all the same
    added = f"prompts=[{CAPTION}, {SHORT}]"
    for command in ("validate", "run"):
        refused = batchvl(command, job_dir / "job.yaml", "--set", added, cwd=job_dir)
        assert refused.returncode == 2, refused.stderr
        assert f"holds 1 shard(s) written with a different config (changed: the {named})" in refused.stderr
        assert "rerun with --overwrite" in refused.stderr
    run_job(config(job_dir, "out", added, "output.overwrite=true"), show_progress=False)
    run_job(config(job_dir, "fresh", added), show_progress=False)
    assert output_rows(job_dir / "out", 1) == output_rows(job_dir / "fresh", 1)


def test_a_marker_from_before_the_identity_is_accepted_and_gets_it(job_dir):
    run_job(config(job_dir, "out"), show_progress=False)
    out = LocalDir(str(job_dir / "out"))
    path = Path(marker_path(out, "part-0.parquet"))
    recorded = json.loads(path.read_text())
    older = json.loads(json.dumps(recorded))  # as an older version wrote it: no identity, no input stamp
    del older["config"]["model"]["checkpoint"]
    older["fingerprint"] = definition_fingerprint(older["config"])
    path.write_text(json.dumps(older))
    stamp = read_input_stamp(out, "part-0.parquet")
    os.remove(input_stamp_path(out, "part-0.parquet"))
    assert batchvl("validate", job_dir / "job.yaml", cwd=job_dir).returncode == 0
    again = run_job(config(job_dir, "out"), show_progress=False)
    assert again.stats["shards_skipped"] == 1 and again.stats["shards_committed"] == 0
    assert json.loads(path.read_text()) == recorded
    restamped = read_input_stamp(out, "part-0.parquet")
    assert restamped.pop("hashed_ns") >= stamp.pop("hashed_ns") and restamped == stamp  # (read again)
    new_weights(job_dir / "model")  # recorded now: a change from here on is refused
    refused = batchvl("validate", job_dir / "job.yaml", cwd=job_dir)
    assert refused.returncode == 2 and "model.checkpoint.weights" in refused.stderr


def test_an_edit_that_keeps_size_and_modification_time_is_seen(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoint_module, "RACY_S", 0.0)  # remember even a file written just now
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"a" * 64)
    before = checkpoint_identity(str(model))
    assert checkpoint_identity(str(model)) == before  # remembered, and the same
    stat = weights.stat()
    with open(weights, "r+b") as file:  # one byte, in place
        file.write(b"b")
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert weights.stat().st_size == stat.st_size and weights.stat().st_mtime_ns == stat.st_mtime_ns
    assert checkpoint_identity(str(model))["weights"] != before["weights"]


def test_a_remembered_digest_that_is_damaged_is_not_trusted(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(checkpoint_module, "RACY_S", 0.0)
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    identity = checkpoint_identity(str(model))
    [remembered] = (tmp_path / "cache").rglob("*.json")
    entries = json.loads(remembered.read_text())
    entries["tokenizer.json"][4] = "not a digest"
    remembered.write_text(json.dumps(entries))
    assert checkpoint_identity(str(model)) == identity
    remembered.write_text("[1, 2")  # cut short
    assert checkpoint_identity(str(model)) == identity
