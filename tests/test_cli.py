"""End to end through the real command line: `python -m batchvl`."""

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForImageTextToText

from tests.conftest import random_image, reference_processor, two_prompt_job_yaml, write_image_shards


def batchvl(*args, cwd=None, env=None, preexec_fn=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "batchvl", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        preexec_fn=preexec_fn,
    )


def png(image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def job(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("job")
    images = [random_image(64 + 20 * i, 90, seed=i) for i in range(3)]
    (root / "data").mkdir()
    pq.write_table(
        pa.table(
            {
                "key": ["a", "b", "c"],
                "image": [png(images[0]), b"garbage", png(images[1])],
                "lang": ["en"] * 3,
            }
        ),
        root / "data" / "part-0.parquet",
    )
    pq.write_table(
        pa.table({"key": ["d"], "image": [png(images[2])], "lang": ["de"]}), root / "data" / "part-1.parquet"
    )
    (root / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{max_num_batched_tokens: 40}"))
    return root, images


def test_run_writes_one_row_per_sample_and_prompt_equal_to_generate(job, tiny_model_dir):
    root, images = job
    result = batchvl("run", root / "job.yaml", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "2 shard(s) written" in result.stdout

    table = pq.read_table(root / "out" / "part-0.parquet").to_pylist()
    assert [(r["key"], r["prompt"]) for r in table] == [
        ("a", "caption"),
        ("a", "short"),
        ("b", "caption"),
        ("b", "short"),
        ("c", "caption"),
        ("c", "short"),
    ]
    bad = [r for r in table if r["key"] == "b"]
    assert all(r["status"] == "error" and r["error_type"] == "image_decode_error" for r in bad)
    assert all(r["error_message"] and r["text"] is None for r in bad)
    assert all(r["lang"] == "en" for r in table)

    # The same text as transformers generate on the same model and rendered prompt.
    processor = reference_processor(tiny_model_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).eval()
    row = table[0]
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe this image."}]}
    ]
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[rendered], images=[images[0]], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False)
    new = out[0, inputs["input_ids"].shape[1] :]
    assert row["status"] == "ok" and row["text"] == processor.tokenizer.decode(new, skip_special_tokens=True)
    assert row["num_prompt_tokens"] == inputs["input_ids"].shape[1]
    assert row["num_output_tokens"] == len(new) and row["finish_reason"] in ("stop", "length")

    meta = pq.read_schema(root / "out" / "part-0.parquet").metadata
    assert json.loads(meta[b"job_config"])["sampling"]["max_new_tokens"] == 6

    (stats_file,) = (root / "out" / "_batchvl" / "stats").glob("run-*.json")
    stats = json.loads(stats_file.read_text())
    assert (stats["samples"], stats["requests"], stats["ok"], stats["errors"]) == (4, 8, 6, 2)
    assert stats["images_total"] == 6 and stats["images_encoded"] == 3
    # the second prompt of an image takes system prompt + image from the prefix cache (or the encoder cache)
    assert stats["prefix_cache_hit_tokens"] > 0 or stats["encoder_cache_hits"] == 3
    assert stats["output_tokens"] == sum(r["num_output_tokens"] for r in table) + sum(
        r["num_output_tokens"] for r in pq.read_table(root / "out" / "part-1.parquet").to_pylist()
    )

    # Rerunning the same command skips committed shards and changes nothing.
    before = (root / "out" / "part-0.parquet").stat().st_mtime_ns
    again = batchvl("run", root / "job.yaml", "--no-progress")
    assert again.returncode == 0 and "2 already done" in again.stdout
    assert (root / "out" / "part-0.parquet").stat().st_mtime_ns == before


def test_validate_lists_shards(job):
    root, _ = job
    result = batchvl("validate", root / "job.yaml")
    assert result.returncode == 0, result.stderr
    assert "2 shard(s), 4 samples" in result.stdout and "qwen2_vl" in result.stdout


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("engine.max_num_seq=3", "did you mean 'engine.max_num_seqs'"),
        ("input.paths=[nowhere/*.parquet]", "no Parquet files match"),
        ("model.path=/definitely/not/a/model", "not a model folder"),
        ("prompts=[{name: year, text: t, regex: '(19|20'}]", "prompt 'year': its regex cannot be used"),
        ("prompts=[{name: kind, text: t, regex: a, choices: [a]}]", "keep one constraint per prompt"),
        ("prompts=[{name: j, text: t, json_schema: {type: objekt}}]", "prompt 'j': its json_schema cannot"),
    ],
)
def test_user_mistakes_are_one_line_exit_2(job, override, fragment):
    root, _ = job
    result = batchvl("run", root / "job.yaml", "--set", override, "--no-progress")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0] and lines[0].startswith("error: ")


def test_debug_shows_the_traceback_and_keeps_exit_2(job):
    root, _ = job
    env = {"BATCHVL_DEBUG": "1"}
    result = batchvl("run", root / "job.yaml", "--set", "engine.max_num_seq=3", "--no-progress", env=env)
    assert result.returncode == 2
    assert "Traceback (most recent call last)" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("error: unknown key 'engine.max_num_seq'")


@pytest.mark.parametrize(
    ("args", "usage", "fragment"),
    [
        (["run", "job.yaml", "--bogus"], "Usage: ", "No such option: --bogus"),
        (["rnu"], "Usage: ", "No such command 'rnu'"),
        (["run"], "Usage: ", "Missing argument"),
        (["run", "job.yaml", "--set"], "", "Option '--set' requires an argument"),
    ],
)
def test_usage_errors_print_the_usage_and_exit_2(tmp_path, args, usage, fragment):
    result = batchvl(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and usage in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: ") and fragment in last


def test_version_prints_the_package_version():
    import batchvl as package

    result = batchvl("--version")
    assert result.returncode == 0 and result.stdout == f"batchvl {package.__version__}\n"


def test_unknown_model_type_is_a_user_error(job, tmp_path):
    root, _ = job
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    result = batchvl("validate", root / "job.yaml", "--set", f"model.path={tmp_path}")
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert "'bert' is not supported" in line
    for family in ("idefics3", "internvl", "llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "smolvlm"):
        assert family in line


def test_make_tiny_model_is_deterministic(tmp_path):
    for name in ("one", "two"):
        assert batchvl("make-tiny-model", tmp_path / name, "--seed", "3").returncode == 0
    read = lambda name: (tmp_path / name / "model.safetensors").read_bytes()  # noqa: E731
    assert read("one") == read("two")
    assert (tmp_path / "one" / "tokenizer.json").read_text() == (
        tmp_path / "two" / "tokenizer.json"
    ).read_text()
    assert Path(tmp_path / "one" / "chat_template.jinja").exists()


def test_ctrl_c_in_any_command_exits_130_without_a_traceback(job, monkeypatch, capsys):
    import batchvl.pipeline.plan
    from batchvl.cli import main

    root, _ = job

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(batchvl.pipeline.plan, "plan_job", interrupted)
    monkeypatch.setattr(sys, "argv", ["batchvl", "validate", str(root / "job.yaml")])
    with pytest.raises(SystemExit) as ended:
        main()
    assert ended.value.code == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted"


def test_a_full_disk_during_a_commit_is_one_line_naming_the_file_and_keeps_the_committed_rows(
    tmp_path, tiny_model_dir
):
    write_image_shards(tmp_path / "data", [2])
    (tmp_path / "job.yaml").write_text(two_prompt_job_yaml(tiny_model_dir, "{}"))
    assert batchvl("run", "job.yaml", "--no-progress", cwd=tmp_path).returncode == 0
    shard = tmp_path / "out" / "part-0.parquet"
    committed = shard.read_bytes()

    def small_files_only():  # the rewrite's marker fits, its Parquet file does not
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write over the limit fails (EFBIG) instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (len(committed) // 2, len(committed) // 2))

    # No preprocessing workers: the limit would hit the shared-memory files they pass tensors in.
    again = ("run", "job.yaml", "--overwrite", "--set", "preprocess.workers=0", "--no-progress")
    result = batchvl(*again, cwd=tmp_path, preexec_fn=small_files_only)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [f"batchvl: cannot write {shard}: File too large (errno 27)"]
    assert shard.read_bytes() == committed
    validate = batchvl("validate", "job.yaml", cwd=tmp_path)
    assert (
        validate.returncode == 0
        and "(1 shard(s) committed as the job defines them, 0 committed with other prompts, 0 to run whole)"
        in validate.stdout
    )
