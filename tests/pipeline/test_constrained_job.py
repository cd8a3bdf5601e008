"""Constrained prompts in a whole job: a JSON schema read from a file beside the job, a regex and choices,
next to a free-text prompt. Every `ok` row of a schema prompt parses and validates against its schema
(checked here with jsonschema), every `ok` choices row is a choice, and an output cut by its token limit
is an `incomplete_output` error row that keeps its text, unless the limit fell just after a whole match."""

import json
import re

import jsonschema
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.config import PromptConfig, load_job_config
from batchvl.pipeline.constraints import output_error
from batchvl.pipeline.runner import run_job
from tests.conftest import png_bytes, random_image

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    },
    "required": ["color", "count"],
}


def write_job(root, model_dir) -> None:
    (root / "data").mkdir()
    images = [png_bytes(random_image(40 + 8 * i, 56, seed=i)) for i in range(6)]
    pq.write_table(
        pa.table({"key": [f"k{i}" for i in range(6)], "image": images}), root / "data" / "s.parquet"
    )
    (root / "schemas").mkdir()
    (root / "schemas" / "attrs.json").write_text(json.dumps(SCHEMA))
    (root / "job.yaml").write_text(f"""
model: {{path: {model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts:
  - {{name: attrs, text: Describe the image as JSON., json_schema: schemas/attrs.json}}
  - {{name: year, text: "Which year?", regex: "(19|20)[0-9]{{2}}"}}
  - {{name: kind, text: "Photo or drawing?", choices: [photo, drawing, screenshot]}}
  - {{name: caption, text: Describe this image.}}
sampling: {{max_new_tokens: 64}}
preprocess: {{workers: 0}}
output: {{dir: out}}
""")


@pytest.fixture(scope="module")
def job_root(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("constrained")
    write_job(root, tiny_model_dir)
    return root


def rows_of(path) -> dict[str, list[dict]]:
    by_prompt: dict[str, list[dict]] = {}
    for row in pq.read_table(path).to_pylist():
        by_prompt.setdefault(row["prompt"], []).append(row)
    return by_prompt


def test_every_ok_row_matches_its_constraint(job_root, loaded_fp32):
    cfg = load_job_config(job_root / "job.yaml")
    assert cfg.prompts[0].json_schema == SCHEMA  # read from the file, relative to the job file
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = rows_of(job_root / "out" / "s.parquet")
    assert {name: len(r) for name, r in rows.items()} == {"attrs": 6, "year": 6, "kind": 6, "caption": 6}
    for row in rows["attrs"]:
        if row["status"] == "ok":
            jsonschema.validate(json.loads(row["text"]), SCHEMA)
        else:  # the random model may run out of tokens inside a string; then the row says so
            assert row["error_type"] in ("incomplete_output", "invalid_output") and row["text"]
    assert any(row["status"] == "ok" for row in rows["attrs"])
    for row in rows["year"]:
        assert row["status"] == "ok" and re.fullmatch("(19|20)[0-9]{2}", row["text"])
    for row in rows["kind"]:  # scored: the most probable choice, with every choice's probability
        probs = dict(row["choice_probs"])
        assert row["status"] == "ok" and set(probs) == {"photo", "drawing", "screenshot"}
        assert sum(probs.values()) == pytest.approx(1.0) and row["text"] == max(probs, key=probs.get)
    assert all(row["choice_probs"] is None for row in rows["caption"])
    assert all(row["status"] == "ok" for row in rows["caption"])


def test_an_output_cut_by_its_token_limit_is_an_incomplete_output_row(job_root, loaded_fp32):
    cfg = load_job_config(job_root / "job.yaml", ["sampling.max_new_tokens=3", "output.dir=cut"])
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = rows_of(job_root / "cut" / "s.parquet")
    for row in rows["attrs"]:  # 3 tokens never hold a whole object with two required keys
        assert (row["status"], row["error_type"]) == ("error", "incomplete_output")
        assert row["text"] and row["text"].startswith("{") and row["num_output_tokens"] == 3
        assert "max_new_tokens" in row["error_message"]
    assert all(row["status"] == "ok" for row in rows["caption"])  # free text cut short is still ok


def test_an_output_cut_by_its_token_limit_just_after_a_whole_match_is_ok(
    tmp_path, tiny_model_dir, loaded_fp32
):
    """The token limit reached on the match's last token, before the end-of-sequence token the grammar
    would force next: the output is whole, so the row is ok (finish_reason `length`), not incomplete."""
    write_job(tmp_path, tiny_model_dir)  # for its images
    (tmp_path / "ab.yaml").write_text(f"""
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts: [{{name: ab, text: "a or b?", regex: "[ab]{{3}}"}}]
preprocess: {{workers: 0}}
""")

    def rows(max_new_tokens: int) -> list[dict]:
        overrides = [f"sampling.max_new_tokens={max_new_tokens}", f"output.dir=out{max_new_tokens}"]
        run_job(load_job_config(tmp_path / "ab.yaml", overrides), loaded=loaded_fp32, show_progress=False)
        return rows_of(tmp_path / f"out{max_new_tokens}" / "s.parquet")["ab"]

    free = rows(16)
    assert len(free) == 6
    # 'a' and 'b' are single tokens of the tiny tokenizer: three of them, then the end-of-sequence token.
    assert {(row["status"], row["finish_reason"], row["num_output_tokens"]) for row in free} == {
        ("ok", "stop", 4)
    }
    cut = rows(3)
    assert [row["text"] for row in cut] == [row["text"] for row in free]
    assert {(row["status"], row["finish_reason"], row["num_output_tokens"]) for row in cut} == {
        ("ok", "length", 3)
    }
    short = rows(2)  # one token earlier the match is not whole
    assert {(row["status"], row["error_type"]) for row in short} == {("error", "incomplete_output")}


def test_a_stop_string_that_cuts_a_match_makes_the_row_invalid(tmp_path, tiny_model_dir, loaded_fp32):
    """The grammar completes `xyz`, then the stop string `z` is cut from the text: the row as written does
    not match its regex, so it is not ok."""
    write_job(tmp_path, tiny_model_dir)  # for its images
    (tmp_path / "xyz.yaml").write_text(f"""
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts: [{{name: xyz, text: "Spell xyz.", regex: xyz}}, {{name: xy, text: "Spell xy.", regex: xy}}]
sampling: {{max_new_tokens: 8, stop: [z]}}
preprocess: {{workers: 0}}
output: {{dir: out}}
""")
    run_job(load_job_config(tmp_path / "xyz.yaml"), loaded=loaded_fp32, show_progress=False)
    rows = rows_of(tmp_path / "out" / "s.parquet")
    assert {(r["status"], r["error_type"], r["text"]) for r in rows["xyz"]} == {
        ("error", "invalid_output", "xy")
    }
    assert {(r["status"], r["text"]) for r in rows["xy"]} == {("ok", "xy")}  # no stop string reached


def test_choices_can_be_generated_under_a_grammar_instead(job_root, loaded_fp32):
    text = (job_root / "job.yaml").read_text()
    (job_root / "generate.yaml").write_text(
        text.replace("screenshot]}", "screenshot], choice_mode: generate}")
    )
    cfg = load_job_config(job_root / "generate.yaml", ["output.dir=generated"])
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    table = pq.read_table(job_root / "generated" / "s.parquet")
    assert "choice_probs" not in table.column_names
    rows = rows_of(job_root / "generated" / "s.parquet")["kind"]
    assert all(row["status"] == "ok" and row["text"] in ("photo", "drawing", "screenshot") for row in rows)


def prompt(**constraint) -> PromptConfig:
    return PromptConfig(name="p", text="t", **constraint)


@pytest.mark.parametrize(
    ("constraint", "text", "problem"),
    [
        (dict(json_schema=SCHEMA), '{"color":"red","count":2}', None),
        (dict(json_schema=SCHEMA), '{"color":"red","count":2', "not valid JSON"),
        (dict(json_schema=SCHEMA), '{"color":"pink","count":2}', "at color: 'pink' is not one of"),
        (dict(json_schema=SCHEMA), '{"color":"red","count":2,"tags":["toolong"]}', "at tags/0"),
        (dict(choices=["photo", "drawing"]), "photo", None),
        (dict(choices=["photo", "drawing"]), "phot", "is not one of the choices ['photo', 'drawing']"),
        (dict(regex="[0-9]+"), "12", None),
        (dict(), "anything", None),
    ],
)
def test_output_checks_name_what_is_wrong(constraint, text, problem):
    error = output_error(prompt(**constraint), text)
    if problem is None:
        assert error is None
    else:
        assert error.error_type == "invalid_output" and problem in error.message


def test_logprob_columns_are_written_when_asked(job_root, loaded_fp32):
    if not (job_root / "out").exists():  # the plain run of the first test, for the comparison below
        run_job(load_job_config(job_root / "job.yaml"), loaded=loaded_fp32, show_progress=False)
    overrides = ["sampling.logprobs=true", "sampling.top_logprobs=2", "output.dir=scored"]
    run_job(load_job_config(job_root / "job.yaml", overrides), loaded=loaded_fp32, show_progress=False)
    table = pq.read_table(job_root / "scored" / "s.parquet")
    assert table.schema.field("mean_logprob").type == pa.float64()
    assert table.schema.field("top_logprobs").type == pa.list_(
        pa.list_(pa.struct([("token", pa.string()), ("token_id", pa.int64()), ("logprob", pa.float64())]))
    )
    for row in table.to_pylist():
        assert row["min_logprob"] <= row["mean_logprob"] <= 0
        assert len(row["top_logprobs"]) == row["num_output_tokens"]
        assert all(len(position) == 2 for position in row["top_logprobs"])
        first = row["top_logprobs"][0]
        assert first[0]["logprob"] >= first[1]["logprob"]
    plain = pq.read_table(job_root / "out" / "s.parquet")  # the job without them has no such columns
    assert not {"mean_logprob", "min_logprob", "top_logprobs"} & set(plain.column_names)
