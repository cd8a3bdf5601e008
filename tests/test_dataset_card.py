"""The dataset card, `output.dir/README.md`: written after each commit, naming the model, the prompts and
their constraints, the rows by status and the label distributions of the committed shards, and updated
by a later run."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq

from batchvl import __version__
from batchvl.config import job_config_from_dict
from batchvl.outputs import dataset_card
from batchvl.outputs.card_summary import summarize
from batchvl.outputs.dataset_card import FIRST_LINE, model_revision
from batchvl.pipeline.runner import run_job
from tests.conftest import TEST_DEVICE, write_image_shards

PROMPTS = [
    {"name": "caption", "text": "Describe | this image."},
    {"name": "kind", "text": "Photo or drawing?", "choices": ["photo", "drawing"]},
    {"name": "year", "text": "Which year?", "regex": "(19|20)[0-9]{2}"},
    {"name": "camera", "text": "Which camera?", "when": {"prompt": "kind", "equals": "photo"}},
]


def job(tmp_path: Path, model_path, data: Path, **output):
    return job_config_from_dict(
        {
            "model": {"path": str(model_path), "dtype": "float32", "device": TEST_DEVICE},
            "input": {"paths": [str(data / "*.parquet")], "key_column": "key"},
            "prompts": PROMPTS,
            "sampling": {"max_new_tokens": 4},
            "engine": {"kv_cache_mb": 8, "block_size": 4},
            "preprocess": {"workers": 0},
            "output": {"dir": str(tmp_path / "out"), **output},
        },
        tmp_path,
    )


def committed_rows(out: Path) -> list[dict]:
    return [row for path in sorted(out.glob("*.parquet")) for row in pq.read_table(path).to_pylist()]


def table_row(card: str, section: str, first_cell: str) -> list[str]:
    """The cells of the table row that starts with `first_cell` in the card's section `section`."""
    text = card.split(f"\n## {section}\n")[1].split("\n## ")[0]
    (line,) = [line for line in text.splitlines() if line.startswith(f"| {first_cell} |")]
    return [cell.strip() for cell in line.strip("|").split("|")][1:]


def check_card(out: Path, num_shards: int) -> str:
    card = (out / "README.md").read_text()
    rows = committed_rows(out)
    assert card.startswith(FIRST_LINE)
    assert f"{num_shards} shard(s) committed" in card
    for prompt in PROMPTS:
        statuses = Counter(row["status"] for row in rows if row["prompt"] == prompt["name"])
        assert table_row(card, "Rows", f"`{prompt['name']}`") == [
            str(statuses[s]) for s in ("ok", "error", "skipped")
        ]
    assert table_row(card, "Rows", "all") == [
        str(sum(r["status"] == s for r in rows)) for s in ("ok", "error", "skipped")
    ]
    for label in ("kind", "year"):
        values = Counter(row["text"] for row in rows if row["prompt"] == label and row["status"] == "ok")
        assert f"`{label}`, {values.total()} ok rows:" in card
        for value, count in values.most_common(10):
            assert table_row(card, "Labels", value)[0] == str(count)
    errors = Counter(row["error_type"] for row in rows if row["status"] == "error")
    for error_type, count in errors.items():
        assert f"`{error_type}` {count}" in card
    return card


def test_the_card_names_the_job_and_counts_the_committed_rows_and_a_later_run_updates_it(
    tmp_path, loaded_fp32, monkeypatch
):
    data = tmp_path / "data"
    write_image_shards(data, [4, 3], replaced={(1, 2): b"not an image"})
    cfg = job(tmp_path, loaded_fp32.path, data)
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    out = Path(cfg.output.dir)
    card = check_card(out, 2)
    marker = json.loads(next((out / "_batchvl" / "done").glob("*.json")).read_text())
    assert f"`{marker['fingerprint']}`" in card and f"batchvl version: {__version__}" in card
    assert f"path: `{loaded_fp32.path}`" in card
    assert "| `caption` | Describe \\| this image. | free text | every sample |" in card  # a pipe escaped
    assert "choices (score): photo, drawing" in card and "regex `(19\\|20)[0-9]{2}`" in card
    assert "when kind is photo" in card and "Sampling: greedy, at most 4 new tokens." in card

    write_image_shards(data, [4, 3, 2])  # a third shard arrives; the two committed are skipped
    counted = []
    monkeypatch.setattr(dataset_card, "summarize", lambda *args: counted.append(args) or summarize(*args))
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    check_card(out, 3)
    assert [args[1] for args in counted] == ["part-2.parquet"]  # the other shards' rows are not read again


def test_a_readme_the_user_wrote_is_left_alone(tmp_path, loaded_fp32):
    data = tmp_path / "data"
    write_image_shards(data, [2])
    cfg = job(tmp_path, loaded_fp32.path, data)
    Path(cfg.output.dir).mkdir()
    readme = Path(cfg.output.dir) / "README.md"
    readme.write_text("# my own notes\n")
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    assert readme.read_text() == "# my own notes\n"
    assert committed_rows(Path(cfg.output.dir))  # the job itself went on


def test_the_models_revision_comes_from_its_checkpoint_folder(tmp_path, tiny_model_dir):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / commit
    assert model_revision(str(snapshot)) == commit
    downloaded = tmp_path / "downloaded"
    shutil.copytree(tiny_model_dir, downloaded)
    assert model_revision(str(downloaded)) is None
    metadata = downloaded / ".cache" / "huggingface" / "download" / "config.json.metadata"
    metadata.parent.mkdir(parents=True)
    metadata.write_text(f"{commit}\nabc\n1700000000.0\n")
    assert model_revision(str(downloaded)) == commit
    cloned = tmp_path / "cloned"
    (cloned / ".git" / "refs" / "heads").mkdir(parents=True)
    (cloned / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (cloned / ".git" / "refs" / "heads" / "main").write_text(commit + "\n")
    assert model_revision(str(cloned)) == commit


def test_the_card_is_written_to_an_object_store_output(tmp_path, loaded_fp32, s3):
    endpoint, client = s3
    client.create_bucket(Bucket="cards")
    data = tmp_path / "data"
    write_image_shards(data, [2, 1])
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    cfg = job(tmp_path, loaded_fp32.path, data, dir="s3://cards/labels", storage_options=options)
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    card = client.get_object(Bucket="cards", Key="labels/README.md")["Body"].read().decode()
    assert card.startswith(FIRST_LINE) and "2 shard(s) committed" in card
    ok, errors, skipped = table_row(card, "Rows", "all")
    assert int(ok) + int(skipped) == 12 and errors == "0"  # 3 samples, 4 prompts


def test_a_card_that_cannot_be_written_leaves_the_run_and_its_shards_alone(tmp_path, loaded_fp32, caplog):
    data = tmp_path / "data"
    write_image_shards(data, [2])
    cfg = job(tmp_path, loaded_fp32.path, data)
    (Path(cfg.output.dir) / "README.md").mkdir(parents=True)  # a folder where the card would go
    summary = run_job(cfg, loaded=loaded_fp32, show_progress=False)
    assert summary.stats["shards_committed"] == 1 and "dataset card" in caplog.text
