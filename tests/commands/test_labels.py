"""The label table: one row per sample, a typed column per prompt (JSON-schema prompts as Arrow types
from their schema, scored choices with their probabilities, free text as strings), from the Python API
and from `batchvl export --wide`."""

import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

import batchvl
from batchvl.commands.labels import arrow_type, arrow_value, job_labels
from batchvl.config import config_fingerprint, job_config_from_dict, load_job_config, output_defining_config
from batchvl.errors import ConfigError, UserError
from batchvl.inputs.sources import job_source
from batchvl.outputs.writers import ResultRow
from batchvl.pipeline.commit_strategies import WriteShard
from batchvl.storage.output_dir import OutputDir
from tests.pipeline.test_constrained_job import write_job
from tests.test_cli import batchvl as batchvl_cli

ATTRS = pa.struct(
    [
        pa.field("color", pa.string(), nullable=False),
        pa.field("count", pa.int64(), nullable=False),
        pa.field("tags", pa.list_(pa.string())),
    ]
)
KIND_PROBS = pa.struct(
    [pa.field(c, pa.float64(), nullable=False) for c in ("photo", "drawing", "screenshot")]
)
LABELS = pa.schema(
    [
        ("shard", pa.string()),
        ("key", pa.string()),
        ("sample_index", pa.int64()),
        ("attrs", ATTRS),
        ("attrs_status", pa.string()),
        ("year", pa.string()),
        ("year_status", pa.string()),
        ("kind", pa.string()),
        ("kind_status", pa.string()),
        ("kind_probs", KIND_PROBS),
        ("caption", pa.string()),
        ("caption_status", pa.string()),
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


def expected_labels(root) -> pa.Table:
    """The label table of the job's committed file, written out here sample by sample."""
    rows = pq.read_table(root / "out" / "s.parquet").to_pylist()
    labels = []
    for index in range(6):
        sample = {row["prompt"]: row for row in rows if row["sample_index"] == index}
        label = {"shard": "s.parquet", "key": f"k{index}", "sample_index": index}
        for name, row in sample.items():
            label[f"{name}_status"] = row["status"]
            label[name] = row["text"] if row["status"] == "ok" else None
        if label["attrs"] is not None:
            parsed = json.loads(label["attrs"])
            label["attrs"] = {"color": parsed["color"], "count": parsed["count"], "tags": parsed.get("tags")}
        label["kind_probs"] = dict(sample["kind"]["choice_probs"])
        labels.append(label)
    return pa.Table.from_pylist(labels, LABELS)


def test_labels_have_a_row_per_sample_and_typed_columns(job_root):
    table = job_labels(load_job_config(job_root / "job.yaml"))
    assert table.equals(expected_labels(job_root))
    assert batchvl.read_labels(job_root / "job.yaml").to_list() == expected_labels(job_root).to_pylist()
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
    # The non-nullable fields are the ones the schema the rows were made with (as the file records it)
    # requires.
    recorded = json.loads(pq.read_schema(job_root / "out" / "s.parquet").metadata[b"job_config"])
    required = recorded["prompts"][0]["json_schema"]["required"]
    assert [f.name for f in table.schema.field("attrs").type if not f.nullable] == required


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
    assert written.equals(expected_labels(job_root))
    committed = pq.read_table(job_root / "out" / "s.parquet").replace_schema_metadata(None)
    rows = pq.read_table(job_root / "rows.parquet")
    assert rows.column("shard").to_pylist() == ["s.parquet"] * 24  # every row, its shard first
    assert rows.drop_columns(["shard"]).equals(committed)
    result = batchvl_cli("export", "job.yaml", cwd=job_root)
    assert result.returncode == 2 and "--wide OUT.parquet" in result.stderr


def test_the_report_shows_label_shares_confidence_and_parsed_fields(job_root):
    from batchvl.commands.report.page import build_report

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


def committed_job(root, prompts: list[dict], shards: dict[str, list[tuple[str, dict]]], **output):
    """A job over Parquet shards `root/data/<shard>` whose outputs are committed as a run commits them,
    with the given rows (no model runs): per shard, its samples as (key, {prompt: (status, text)})."""
    (root / "data").mkdir()
    for shard, samples in shards.items():
        pq.write_table(pa.table({"key": [key for key, _ in samples], "image": [b""] * len(samples)}),
                       root / "data" / shard)  # fmt: skip
    job = {
        "model": {"path": "model"},
        "input": {"paths": ["data/*.parquet"], "key_column": "key"},
        "prompts": prompts,
        "output": {"dir": "out", **output},
    }
    (root / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    cfg = load_job_config(root / "job.yaml")
    commit = WriteShard(
        cfg, OutputDir.of(cfg.output), None, output_defining_config(cfg), config_fingerprint(cfg)
    )
    for info in job_source(cfg).list_shards():
        rows = [
            ResultRow(key, index, name, number, text, status, None if status == "ok" else "invalid_output",
                      None if status == "ok" else "not valid", 5, 3, "stop", 1, 0.1)
            for index, (key, outputs) in enumerate(shards[info.shard])
            for number, (name, (status, text)) in enumerate(outputs.items())
        ]  # fmt: skip
        commit(info, rows)
    return cfg


def test_null_and_one_other_type_is_that_type_in_either_order():
    for kinds in (["integer", "null"], ["null", "integer"]):
        assert arrow_type({"type": kinds}) == pa.int64()
        schema = {"type": "object", "properties": {"n": {"type": kinds}}, "required": ["n"]}
        assert arrow_type(schema) == pa.struct([pa.field("n", pa.int64())])  # required, yet null is valid
    assert arrow_type({"enum": [None, 1, 2]}) == pa.int64()
    assert arrow_type({"type": "null"}) == pa.null() and arrow_type({"const": None}) == pa.null()


def test_the_same_key_in_two_shards_is_two_samples(tmp_path):
    prompts = [{"name": "n", "text": "How many?", "json_schema": {"type": ["null", "integer"]}}]
    cfg = committed_job(
        tmp_path,
        prompts,
        {
            "a.parquet": [("k0", {"n": ("ok", "3")}), ("k1", {"n": ("ok", "null")})],
            "b.parquet": [("k0", {"n": ("error", "{")})],
        },
    )
    expected = pa.table(
        {
            "shard": ["a.parquet", "a.parquet", "b.parquet"],
            "key": ["k0", "k1", "k0"],
            "sample_index": [0, 1, 0],
            "n": pa.array([3, None, None], pa.int64()),
            "n_status": ["ok", "ok", "error"],
        }
    )
    assert job_labels(cfg).equals(expected)
    assert batchvl.read_labels(cfg).to_list() == expected.to_pylist()


BIG = 2**70  # beyond int64
HUGE = 10**400  # beyond a double


def test_numbers_beyond_their_column_type_are_kept_as_json_text(tmp_path):
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "ids": {"type": "array", "items": {"type": "integer"}},
        },
        "required": ["n", "x"],
    }
    values = [{"n": BIG, "x": 1, "ids": [1, BIG]}, {"n": 5, "x": HUGE, "ids": [2]}, {"n": -3, "x": 2.5}]
    cfg = committed_job(
        tmp_path,
        [{"name": "j", "text": "JSON", "json_schema": schema}],
        {"s.parquet": [(f"k{i}", {"j": ("ok", json.dumps(v))}) for i, v in enumerate(values)]},
    )
    j_type = pa.struct(
        [
            pa.field("n", pa.string(), nullable=False),
            pa.field("x", pa.string(), nullable=False),
            pa.field("ids", pa.list_(pa.string())),
        ]
    )
    expected = pa.Table.from_pydict(
        {
            "shard": ["s.parquet"] * 3,
            "key": ["k0", "k1", "k2"],
            "sample_index": [0, 1, 2],
            "j": [
                {"n": str(BIG), "x": "1", "ids": ["1", str(BIG)]},
                {"n": "5", "x": str(HUGE), "ids": ["2"]},
                {"n": "-3", "x": "2.5", "ids": None},
            ],
            "j_status": ["ok"] * 3,
        },
        pa.schema([("shard", pa.string()), ("key", pa.string()), ("sample_index", pa.int64()),
                   ("j", j_type), ("j_status", pa.string())]),
    )  # fmt: skip
    notes = [
        "j.n: 1180591620717411303424 does not fit int64; the column holds JSON text",
        f"j.x: 1{'0' * 39} does not fit double; the column holds JSON text",
        "j.ids[]: 1180591620717411303424 does not fit int64; the column holds JSON text",
    ]
    with pytest.warns(UserWarning) as warned:
        assert batchvl.read_labels(cfg).to_list() == expected.to_pylist()
    assert [str(warning.message) for warning in warned] == notes
    result = batchvl_cli("export", "job.yaml", "--wide", "labels.parquet", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert pq.read_table(tmp_path / "labels.parquet").equals(expected)
    assert result.stdout.splitlines() == ["wrote labels.parquet (3 rows)"] + [f"note: {n}" for n in notes]


def test_a_null_property_and_a_boolean_subschema_get_columns(tmp_path):
    schema = {
        "type": "object",
        "properties": {"a": True, "z": {"type": "null"}, "b": {"type": "string"}},
        "required": ["a", "z", "b"],
    }
    j_type = pa.struct(
        [pa.field("a", pa.string()), pa.field("z", pa.null()), pa.field("b", pa.string(), nullable=False)]
    )
    table_schema = pa.schema([("shard", pa.string()), ("key", pa.string()), ("sample_index", pa.int64()),
                              ("j", j_type), ("j_status", pa.string())])  # fmt: skip
    value = {"a": [1, {"b": 2}], "z": None, "b": "x"}
    cfg = committed_job(
        tmp_path,
        [{"name": "j", "text": "JSON", "json_schema": schema}],
        {"s.parquet": [("k0", {"j": ("ok", json.dumps(value))})]},
    )
    expected = pa.Table.from_pylist(
        [{"shard": "s.parquet", "key": "k0", "sample_index": 0, "j_status": "ok",
          "j": {"a": '[1, {"b": 2}]', "z": None, "b": "x"}}],
        table_schema,
    )  # fmt: skip
    assert job_labels(cfg).equals(expected)
    never_ran = load_job_config(tmp_path / "job.yaml", ["output.dir=never-ran"])
    assert job_labels(never_ran).equals(table_schema.empty_table())


def test_export_report_and_reads_refuse_rows_of_another_config_as_run_does(tmp_path):
    prompts = [{"name": "j", "text": "Colour?", "json_schema": {"type": "string"}}]
    committed_job(tmp_path, prompts, {"s.parquet": [("k0", {"j": ("ok", '"red"')})]})
    job = tmp_path / "job.yaml"
    job.write_text(job.read_text().replace("type: string", "type: integer"))  # the schema changed since
    status = batchvl_cli("status", "job.yaml", cwd=tmp_path)
    assert "1 shard(s) were written with other prompts or sampling; a run keeps" in status.stdout
    refusal = (
        f"error: {tmp_path / 'out'} holds 1 shard(s) written with other prompts or sampling; run the job to "
        "update them (the rows of unchanged prompts are kept), or set output.dir to a new folder"
    )
    for command in (["export", "--wide", "labels.parquet", "--rows", "rows.parquet"], ["report"]):
        result = batchvl_cli(*command[:1], "job.yaml", *command[1:], cwd=tmp_path)
        assert (result.returncode, result.stderr.splitlines()) == (2, [refusal])
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "job.yaml", "out"]  # nothing written
    assert not (tmp_path / "out" / "report.html").exists()
    for read in (batchvl.read_labels, batchvl.read_results):
        with pytest.raises(
            UserError, match=r"written with other prompts or sampling; run the job to update them"
        ):
            read(job)


RESERVED = "(reserved: shard, key, sample_index and each prompt's <name>_status/<name>_probs); rename"


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["key"], f"prompt name 'key' would replace the key column in the labels {RESERVED}"),
        (["shard"], f"prompt name 'shard' would replace the shard column in the labels {RESERVED}"),
        (["sample_index"], "prompt name 'sample_index' would replace the sample_index column in the labels"),
        (["a", "a_status"], "prompt name 'a_status' would replace prompt 'a''s a_status column in the"),
        (["a_probs", "a"], "prompt name 'a_probs' would replace prompt 'a''s a_probs column in the labels"),
        (["a", ""], "'prompts' names must not be empty, got ['a', '']; name each prompt"),
        (["a", " "], "'prompts' names must not be empty, got ['a', ' ']; name each prompt"),
    ],
)  # fmt: skip
def test_prompt_names_that_are_label_columns_are_refused(names, message):
    job = {"model": {"path": "m"}, "input": {"paths": ["d/*.parquet"]}, "output": {"dir": "out"}}
    with pytest.raises(ConfigError) as refused:
        job_config_from_dict({**job, "prompts": [{"name": name, "text": "t"} for name in names]})
    assert message in str(refused.value)


def test_a_prompt_name_that_is_a_label_column_is_one_line_exit_2_before_any_work(tmp_path):
    (tmp_path / "job.yaml").write_text(
        "model: {path: nowhere}\ninput: {paths: [nowhere/*.parquet]}\n"
        "prompts: [{name: a, text: t}, {name: a_status, text: t}]\noutput: {dir: out}\n"
    )
    result = batchvl_cli("validate", "job.yaml", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line.startswith("error: prompt name 'a_status' would replace prompt 'a''s a_status column")


def test_export_writes_to_an_object_store_with_the_outputs_storage_options(tmp_path, s3):
    endpoint, client = s3
    client.create_bucket(Bucket="exports")
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    prompts = [{"name": "n", "text": "How many?", "json_schema": {"type": "integer"}}]
    committed_job(tmp_path, prompts, {"s.parquet": [("k0", {"n": ("ok", "4")})]}, storage_options=options)
    args = ["--wide", "s3://exports/x/labels.parquet", "--rows", "s3://exports/x/rows.parquet"]
    result = batchvl_cli("export", "job.yaml", *args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "wrote s3://exports/x/rows.parquet (1 rows)",
        "wrote s3://exports/x/labels.parquet (1 rows)",
    ]

    def written(key: str) -> pa.Table:
        return pq.read_table(io.BytesIO(client.get_object(Bucket="exports", Key=key)["Body"].read()))

    assert written("x/labels.parquet").equals(
        pa.table({"shard": ["s.parquet"], "key": ["k0"], "sample_index": [0], "n": [4], "n_status": ["ok"]})
    )
    rows = written("x/rows.parquet").select(["shard", "key", "prompt", "text", "status"])
    assert rows.to_pylist() == [
        {"shard": "s.parquet", "key": "k0", "prompt": "n", "text": "4", "status": "ok"}
    ]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "job.yaml", "out"]  # no local s3:/


def test_export_refuses_a_job_never_run_and_one_file_for_both_tables(tmp_path):
    prompts = [{"name": "caption", "text": "Describe."}]
    committed_job(tmp_path, prompts, {"s.parquet": [("k0", {"caption": ("ok", "a cat")})]})
    never_ran = ["--set", "output.dir=never-ran"]
    result = batchvl_cli("export", "job.yaml", "--wide", "labels.parquet", *never_ran, cwd=tmp_path)
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        [
            f"error: output.dir {tmp_path / 'never-ran'} does not exist: run the job first (batchvl run), "
            "or point output.dir at the folder it wrote"
        ],
    )
    result = batchvl_cli(
        "export", "job.yaml", "--wide", "both.parquet", "--rows", "./both.parquet", cwd=tmp_path
    )
    assert (result.returncode, result.stderr.splitlines()) == (
        2,
        ["error: export: --wide and --rows both name both.parquet; give each its own file"],
    )
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "job.yaml", "out"]  # nothing written
    committed = (tmp_path / "out" / "s.parquet").read_bytes()
    for flag in ("--wide", "--rows"):  # over a committed shard: it would be replaced
        result = batchvl_cli("export", "job.yaml", flag, "out/s.parquet", cwd=tmp_path)
        assert (result.returncode, len(result.stderr.splitlines())) == (2, 1), result.stderr
        assert "export: out/s.parquet is inside output.dir" in result.stderr
    assert (tmp_path / "out" / "s.parquet").read_bytes() == committed
