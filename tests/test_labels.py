"""The label table: one row per sample, a typed column per prompt (JSON-schema prompts as Arrow types
from their schema, scored choices with their probabilities, free text as strings), from the Python API
and from `batchvl export --wide`."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchvl
from batchvl.config import load_job_config
from batchvl.labels import arrow_type, arrow_value, job_labels
from tests.test_cli import batchvl as batchvl_cli
from tests.test_constrained_job import SCHEMA, write_job

ATTRS = pa.struct(
    [
        pa.field("color", pa.string(), nullable=False),
        pa.field("count", pa.int64(), nullable=False),
        pa.field("tags", pa.list_(pa.string())),
    ]
)


def test_schema_types_become_arrow_types():
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "size": {"type": ["number", "null"]},
            "kind": {"enum": ["a", "b"]},
            "level": {"enum": [1, 2, 3]},
            "ok": {"type": "boolean"},
            "boxes": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            "extra": {"type": "object"},  # no properties: kept as JSON text
            "either": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        },
        "required": ["name", "ok"],
    }
    assert arrow_type(schema) == pa.struct(
        [
            pa.field("name", pa.string(), nullable=False),
            pa.field("size", pa.float64()),
            pa.field("kind", pa.string()),
            pa.field("level", pa.int64()),
            pa.field("ok", pa.bool_(), nullable=False),
            pa.field("boxes", pa.list_(pa.list_(pa.int64()))),
            pa.field("extra", pa.string()),
            pa.field("either", pa.string()),
        ]
    )
    value = {"name": "x", "ok": True, "boxes": [[1, 2]], "extra": {"k": [1]}, "either": 3, "unknown": 1}
    assert arrow_value(value, arrow_type(schema)) == {
        "name": "x", "size": None, "kind": None, "level": None, "ok": True,
        "boxes": [[1, 2]], "extra": '{"k": [1]}', "either": "3",
    }  # fmt: skip


@pytest.fixture(scope="module")
def job_root(tmp_path_factory, tiny_model_dir, loaded_fp32):
    root = tmp_path_factory.mktemp("labels")
    write_job(root, tiny_model_dir)
    batchvl.run(root / "job.yaml", model=loaded_fp32, progress=False)
    return root


def test_labels_have_a_row_per_sample_and_typed_columns(job_root):
    table = job_labels(load_job_config(job_root / "job.yaml"))
    assert batchvl.read_labels(job_root / "job.yaml").to_list() == table.to_pylist()  # as a Dataset
    assert table.num_rows == 6 and table.column("key").to_pylist() == [f"k{i}" for i in range(6)]
    assert table.schema.field("attrs").type == ATTRS
    assert table.schema.field("kind_probs").type == pa.struct(
        [pa.field(choice, pa.float64(), nullable=False) for choice in ("photo", "drawing", "screenshot")]
    )
    for name in ("year", "kind", "caption"):
        assert table.schema.field(name).type == pa.string()
    rows = {(r["key"], r["prompt"]): r for r in pq.read_table(job_root / "out" / "s.parquet").to_pylist()}
    for label in table.to_pylist():
        attrs = rows[(label["key"], "attrs")]
        assert label["attrs_status"] == attrs["status"]
        if attrs["status"] == "ok":
            parsed = json.loads(attrs["text"])
            assert label["attrs"] == {
                "color": parsed["color"],
                "count": parsed["count"],
                "tags": parsed.get("tags"),
            }
        else:
            assert label["attrs"] is None
        kind = rows[(label["key"], "kind")]
        assert label["kind"] == kind["text"] and label["kind_probs"] == dict(kind["choice_probs"])
        assert label["caption"] == rows[(label["key"], "caption")]["text"]
    assert SCHEMA["required"] == ["color", "count"]  # the non-nullable fields above


def test_the_rows_api_keeps_choice_probs_as_key_value_lists(job_root):
    rows = batchvl.read_results(job_root / "job.yaml")  # datasets has no map type
    kind = next(row for row in rows if row["prompt"] == "kind")
    assert {entry["key"] for entry in kind["choice_probs"]} == {"photo", "drawing", "screenshot"}
    assert sum(entry["value"] for entry in kind["choice_probs"]) == pytest.approx(1.0)


def test_export_writes_the_labels_and_the_rows(job_root):
    args = ["--wide", "labels.parquet", "--rows", "rows.parquet"]
    result = batchvl_cli("export", "job.yaml", *args, cwd=job_root)
    assert result.returncode == 0, result.stderr
    written = pq.read_table(job_root / "labels.parquet")
    assert written.equals(job_labels(load_job_config(job_root / "job.yaml")))
    committed = pq.read_table(job_root / "out" / "s.parquet").replace_schema_metadata(None)
    rows = pq.read_table(job_root / "rows.parquet")
    assert rows.column("shard").to_pylist() == ["s.parquet"] * 24  # every row, its shard first
    assert rows.drop_columns(["shard"]).equals(committed)
    result = batchvl_cli("export", "job.yaml", cwd=job_root)
    assert result.returncode == 2 and "--wide OUT.parquet" in result.stderr


def test_the_report_shows_label_shares_confidence_and_parsed_fields(job_root):
    from batchvl.report.page import build_report

    cfg = load_job_config(job_root / "job.yaml")
    report = build_report(cfg, samples=6)
    rows = pq.read_table(job_root / "out" / "s.parquet").to_pylist()
    kinds = [row["text"] for row in rows if row["prompt"] == "kind"]
    for choice in ("photo", "drawing", "screenshot"):  # every choice listed, with its count of rows
        assert f"<td>{choice}</td><td>{kinds.count(choice)}</td>" in report.html
    assert "kind: probability of the label" in report.html and "winning choice, % (6 rows)" in report.html
    valid = sum(row["status"] == "ok" for row in rows if row["prompt"] == "attrs")
    assert f"({valid} of 6 rows)" in report.html
    ok_attrs = next(row for row in rows if row["prompt"] == "attrs" and row["status"] == "ok")
    color = json.loads(ok_attrs["text"])["color"]
    assert f'<dt>color</dt><dd>"{color}"</dd>' in report.html  # the gallery shows parsed fields
