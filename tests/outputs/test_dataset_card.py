"""The dataset card, `output.dir/README.md`: written after each commit, with the header that loads the
folder as a dataset, naming the model, the prompts and their constraints, the rows by status and the label
distributions of the committed shards, quoting what users and models wrote as written, and updated by a
later run."""

import json
import shutil
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import yaml
from markdown_it import MarkdownIt

from batchvl import __version__
from batchvl.config import job_config_from_dict
from batchvl.outputs import dataset_card
from batchvl.outputs.card_summary import ShardSummary, summarize
from batchvl.outputs.dataset_card import FIRST_LINES, model_name, model_revision
from batchvl.pipeline.runner import run_job
from batchvl.storage.output_dir import LocalDir
from tests.conftest import TEST_DEVICE, write_image_shards

PROMPTS = [
    {"name": "caption", "text": "Describe | this image."},
    {"name": "kind", "text": "Photo or drawing?", "choices": ["photo", "drawing"]},
    {"name": "year", "text": "Which year?", "regex": "(19|20)[0-9]{2}"},
    {"name": "camera", "text": "Which camera?", "when": {"prompt": "kind", "equals": "photo"}},
]


def job(tmp_path: Path, model_path, data: Path, prompts: list[dict] = PROMPTS, **output):
    return job_config_from_dict(
        {
            "model": {"path": str(model_path), "dtype": "float32", "device": TEST_DEVICE},
            "input": {"paths": [str(data / "*.parquet")], "key_column": "key"},
            "prompts": prompts,
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
    assert card.startswith(FIRST_LINES)
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
    assert "name: `tiny-qwen2-vl`" in card and str(loaded_fp32.path) not in card  # not the writer's folders
    assert "| `caption` | Describe \\| this image. | free text | every sample |" in card  # a pipe escaped
    assert "choices (score): photo, drawing" in card and "regex `(19\\|20)[0-9]{2}`" in card
    assert "when `kind` is photo" in card and "Sampling: greedy, at most 4 new tokens." in card

    write_image_shards(tmp_path / "more", [4, 3, 2])  # a third shard arrives; the two committed are skipped
    (tmp_path / "more" / "part-2.parquet").rename(data / "part-2.parquet")
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
    assert model_name(str(snapshot)) == "org/name" and model_name(str(cloned)) == "cloned"


def test_the_card_is_written_to_an_object_store_output(tmp_path, loaded_fp32, s3):
    endpoint, client = s3
    client.create_bucket(Bucket="cards")
    data = tmp_path / "data"
    write_image_shards(data, [2, 1])
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    cfg = job(tmp_path, loaded_fp32.path, data, dir="s3://cards/labels", storage_options=options)
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    card = client.get_object(Bucket="cards", Key="labels/README.md")["Body"].read().decode()
    assert card.startswith(FIRST_LINES) and "2 shard(s) committed" in card
    ok, errors, skipped = table_row(card, "Rows", "all")
    assert int(ok) + int(skipped) == 12 and errors == "0"  # 3 samples, 4 prompts


def test_a_card_that_cannot_be_written_leaves_the_run_and_its_shards_alone(tmp_path, loaded_fp32, caplog):
    data = tmp_path / "data"
    write_image_shards(data, [2])
    cfg = job(tmp_path, loaded_fp32.path, data)
    (Path(cfg.output.dir) / "README.md").mkdir(parents=True)  # a folder where the card would go
    summary = run_job(cfg, loaded=loaded_fp32, show_progress=False)
    assert summary.stats["shards_committed"] == 1 and "dataset card" in caplog.text


def summary_of(
    shard: str, prompts: list[dict], statuses: dict, out_dir: str = "/data/labels"
) -> ShardSummary:
    config = {
        "output": {"dir": out_dir},
        "model": {"path": "/home/someone/models/tiny-qwen2-vl", "dtype": "float32"},
        "prompts": prompts,
        "sampling": {"temperature": 0.0, "max_new_tokens": 4},
    }
    return ShardSummary(shard, "fp", config, __version__, statuses=statuses)


def markdown_tokens(markdown: str) -> list:
    """The tokens of Markdown as a CommonMark reader with tables sees it."""
    return MarkdownIt("commonmark").enable("table").parse(markdown)


def shown(inline) -> str:
    """What a reader sees of an inline token: its text and code spans."""
    return "".join(child.content for child in inline.children if child.type in ("text", "code_inline"))


def table_cells(tokens: list) -> list[list[str]]:
    """What a reader sees of each row of the first table (its header first)."""
    rows, row = [], []
    for token in tokens[next(i for i, t in enumerate(tokens) if t.type == "table_open") :]:
        if token.type == "inline":
            row.append(shown(token))
        elif token.type == "tr_close":
            rows, row = [*rows, row], []
        elif token.type == "table_close":
            return rows
    raise AssertionError("no table")


def test_what_users_and_models_wrote_shows_as_written_never_as_html_or_hidden_characters():
    hostile = "<details><summary>x</summary> </table><script>alert(1)</script> <!-- a \\| b *c* [d](e) &lt; #"
    prompts = [
        {"name": "caption", "text": hostile},
        {"name": "nul\x00name", "text": "left\u202eright\x00end"},
        {"name": "tick`s", "text": "a `b` c", "regex": "``x|`y`"},
        {
            "name": "kind",
            "text": "Which?",
            "choices": ["</table>", "a|b"],
            "when": {"prompt": "tick`s", "equals": "<b>"},
        },
    ]
    summary = summary_of("part-0.parquet", prompts, {"caption": {"ok": 1}, "kind": {"ok": 2}}, "/data/<b>x")
    summary.labels = {"kind": {"</table>": 1, "a|b": 1}}
    card = dataset_card.render(summary, [summary])
    assert "\x00" not in card and "\u202e" not in card

    tokens = markdown_tokens(card.split("\n---\n", 1)[1])  # below the YAML header
    assert not [t for t in tokens if t.type == "html_block"]
    assert not [c for t in tokens if t.type == "inline" for c in t.children if c.type == "html_inline"]
    assert shown(next(t for t in tokens if t.type == "inline")) == "<b>x"  # the title: the folder's name
    assert table_cells(tokens)[1:] == [
        ["caption", hostile, "free text", "every sample"],
        ["nul\\u0000name", "left\\u202eright\\u0000end", "free text", "every sample"],
        ["tick`s", "a `b` c", "regex ``x|`y`", "every sample"],
        ["kind", "Which?", "choices (score): </table>, a|b", "when tick`s is <b>"],
    ]
    labels = table_cells(markdown_tokens(card.split("`kind`, 2 ok rows:")[1]))
    assert sorted(labels[1:]) == [["</table>", "1", "50.0%"], ["a|b", "1", "50.0%"]]


def load_folder(out: Path, cache: Path) -> list[dict]:
    """The rows `datasets` loads from the folder, as a dataset hub would, by the card's header."""
    import datasets

    return datasets.load_dataset(str(out), cache_dir=str(cache))["train"].to_list()


def test_the_header_names_the_committed_files_of_every_folder_and_leaves_batchvls_own_out(tmp_path):
    out = tmp_path / "out"
    shards = ["top.parquet", "sub/b.parquet", "odd[1]/c.parquet"]
    for number, shard in enumerate(shards):
        (out / shard).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"key": [f"k{number}"], "text": ["a caption"]}), out / shard)
    staged = out / "_batchvl" / "input" / "staged.parquet"  # a notebook's staged input: not a result
    staged.parent.mkdir(parents=True)
    pq.write_table(pa.table({"image": [b"\x89PNG"]}), staged)
    prompts = [{"name": "caption", "text": "Describe the image."}, {"name": "kind", "text": "Is it a photo?"}]
    summaries = [summary_of(shard, prompts, {"caption": {"ok": 1}}) for shard in shards]
    card = dataset_card.render(summaries[0], summaries)
    (out / "README.md").write_text(card)

    header = yaml.safe_load(card.split("---\n")[1])
    assert header["task_categories"] == ["image-to-text", "visual-question-answering"]
    assert sorted(row["key"] for row in load_folder(out, tmp_path / "cache")) == ["k0", "k1", "k2"]


def test_the_folder_a_run_writes_loads_as_a_dataset_and_a_card_an_earlier_version_wrote_is_kept_current(
    tmp_path, loaded_fp32
):
    data = tmp_path / "data"
    write_image_shards(data, [2, 1])
    # not a scored choices prompt: it writes `choice_probs` as a Parquet map, which `datasets` cannot read
    cfg = job(tmp_path, loaded_fp32.path, data, [p for p in PROMPTS if p["name"] in ("caption", "year")])
    out = Path(cfg.output.dir)
    out.mkdir()
    (out / "README.md").write_text(dataset_card.EARLIER_FIRST_LINE + "\n\n# out\n")
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    assert (out / "README.md").read_text().startswith(FIRST_LINES)
    loaded = load_folder(out, tmp_path / "cache")
    assert [(r["key"], r["prompt"], r["text"]) for r in loaded] == [
        (r["key"], r["prompt"], r["text"]) for r in committed_rows(out)
    ]


class StoreError(Exception):
    """An object store's own exception, not an OSError (as botocore's are)."""


def test_an_object_stores_own_error_writing_the_card_leaves_the_run_and_its_shards_alone(
    tmp_path, loaded_fp32, caplog, monkeypatch
):
    write_bytes = LocalDir.write_bytes

    def refusing_the_card(self, location, data):
        if location.endswith("README.md"):
            raise StoreError("the store refused the upload")
        write_bytes(self, location, data)

    monkeypatch.setattr(LocalDir, "write_bytes", refusing_the_card)
    data = tmp_path / "data"
    write_image_shards(data, [1])
    cfg = job(tmp_path, loaded_fp32.path, data, PROMPTS[:1])
    summary = run_job(cfg, loaded=loaded_fp32, show_progress=False)
    assert summary.stats["shards_committed"] == 1 and "the store refused the upload" in caplog.text
    assert not (Path(cfg.output.dir) / "README.md").exists() and committed_rows(Path(cfg.output.dir))


def test_a_prompt_found_only_in_an_earlier_shard_keeps_its_rows_in_the_table():
    earlier = summary_of("part-0.parquet", PROMPTS[:2], {"caption": {"ok": 3}, "kind": {"ok": 2, "error": 1}})
    current = summary_of("part-1.parquet", PROMPTS[:1], {"caption": {"ok": 4}})
    card = dataset_card.render(current, [earlier, current])
    assert table_row(card, "Rows", "`caption`") == ["7", "0", "0"]
    assert table_row(card, "Rows", "`kind`") == ["2", "1", "0"]
    assert table_row(card, "Rows", "all") == ["9", "1", "0"]
