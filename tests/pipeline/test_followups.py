"""Follow-up prompts in one job: a prompt that inserts an earlier prompt's output, one that continues an
earlier prompt's conversation, and prompts that run only where a scored choice matches. Each follow-up's
output equals transformers `generate` on the same conversation built with the model's own processor;
every (sample, prompt) has exactly one row; a follow-up whose input failed is an error that
retry-failed reruns together with its input; references to later, own or unknown prompts are refused
before any work."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.commands.retry import retry_failed
from batchvl.config import job_config_from_dict, load_job_config
from batchvl.errors import UserError
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.runner import run_job
from tests.conftest import png_bytes, random_image, reference_processor
from tests.test_cli import batchvl

NUM_SAMPLES = 5
CAPTION = "Describe this image."
REFINE = "Refine this caption: {caption}"
SHORTER = "Now say it in five words."
NEW_TOKENS = 8


def write_job(root, model_dir, attrs_tokens: int = NEW_TOKENS) -> None:
    (root / "data").mkdir(exist_ok=True)
    images = [png_bytes(random_image(40 + 8 * i, 56, seed=30 + i)) for i in range(NUM_SAMPLES)]
    keys = [f"k{i}" for i in range(NUM_SAMPLES)]
    pq.write_table(pa.table({"key": keys, "image": images}), root / "data" / "s.parquet")
    (root / "job.yaml").write_text(f"""
model: {{path: {model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts:
  - {{name: caption, text: {CAPTION}}}
  - {{name: kind, text: "Photo, drawing or screenshot?", choices: [photo, drawing, screenshot]}}
  - {{name: refine, text: "{REFINE}"}}
  - {{name: shorter, continue: caption, text: {SHORTER}}}
  - {{name: photo_only, text: "Who took it?", when: {{prompt: kind, equals: photo}}}}
  - {{name: not_photo, text: "Who made it?", when: {{prompt: kind, in: [drawing, screenshot]}}}}
  - {{name: made_more, text: "Say more about {{not_photo}}"}}
sampling: {{max_new_tokens: {NEW_TOKENS}}}
preprocess: {{workers: 1}}
output: {{dir: out}}
""")


@pytest.fixture(scope="module")
def job_root(tmp_path_factory, tiny_model_dir, loaded_fp32):
    root = tmp_path_factory.mktemp("followups")
    write_job(root, tiny_model_dir)
    summary = run_job(load_job_config(root / "job.yaml"), loaded=loaded_fp32, show_progress=False)
    return root, summary


def rows_by(path) -> dict[tuple[str, str], dict]:
    rows = pq.read_table(path).to_pylist()
    by = {(row["key"], row["prompt"]): row for row in rows}
    assert len(by) == len(rows)  # exactly one row per (sample, prompt)
    return by


def generate_text(model, processor, messages: list[dict], image) -> str:
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[rendered], images=[image], return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def user(text: str, image: bool = False) -> dict:
    content = ([{"type": "image"}] if image else []) + [{"type": "text", "text": text}]
    return {"role": "user", "content": content}


def test_follow_ups_equal_generate_on_the_same_conversation(job_root, tiny_model_dir):
    root, summary = job_root
    rows = rows_by(root / "out" / "s.parquet")
    assert len(rows) == NUM_SAMPLES * 7
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    processor = reference_processor(tiny_model_dir)
    for i in range(NUM_SAMPLES):
        key, image = f"k{i}", random_image(40 + 8 * i, 56, seed=30 + i)
        caption = rows[(key, "caption")]["text"]
        assert rows[(key, "caption")]["status"] == "ok"
        assert caption == generate_text(model, processor, [user(CAPTION, image=True)], image)
        refined = generate_text(model, processor, [user(REFINE.format(caption=caption), image=True)], image)
        assert (rows[(key, "refine")]["status"], rows[(key, "refine")]["text"]) == ("ok", refined)
        conversation = [
            user(CAPTION, image=True),
            {"role": "assistant", "content": [{"type": "text", "text": caption}]},
            user(SHORTER),
        ]
        shorter = generate_text(model, processor, conversation, image)
        assert (rows[(key, "shorter")]["status"], rows[(key, "shorter")]["text"]) == ("ok", shorter)
    # the continued conversation's first turn came from the prefix cache, its image from the encoder cache
    stats = summary.stats
    assert stats["prefix_cache_hit_tokens"] > NUM_SAMPLES * 16
    assert stats["images_encoded"] == NUM_SAMPLES


def test_when_runs_a_prompt_only_where_the_choice_matches(job_root):
    root, summary = job_root
    rows = rows_by(root / "out" / "s.parquet")
    for i in range(NUM_SAMPLES):
        kind = rows[(f"k{i}", "kind")]["text"]
        photo, other = rows[(f"k{i}", "photo_only")], rows[(f"k{i}", "not_photo")]
        ran, skipped = (photo, other) if kind == "photo" else (other, photo)
        assert ran["status"] == "ok" and ran["text"] is not None
        assert (skipped["status"], skipped["text"], skipped["error_type"]) == ("skipped", None, None)
        # a prompt that uses a skipped prompt's output is skipped too; it runs where its input ran
        assert rows[(f"k{i}", "made_more")]["status"] == ("skipped" if kind == "photo" else "ok")
    photos = sum(rows[(f"k{i}", "kind")]["text"] == "photo" for i in range(NUM_SAMPLES))
    assert photos > 0  # so a skipped input was met
    assert summary.stats["skipped"] == NUM_SAMPLES + photos
    assert summary.stats["errors"] == 0


def test_a_failed_input_fails_its_follow_ups_and_retry_reruns_them(tmp_path, tiny_model_dir, loaded_fp32):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    schema["required"] = ["n"]
    (tmp_path / "data").mkdir()
    images = [png_bytes(random_image(48, 56, seed=50 + i)) for i in range(3)]
    pq.write_table(pa.table({"key": ["a", "b", "c"], "image": images}), tmp_path / "data" / "s.parquet")
    job = {
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "input": {"paths": [str(tmp_path / "data" / "*.parquet")], "key_column": "key"},
        "prompts": [
            {"name": "attrs", "text": "As JSON.", "json_schema": schema},
            {"name": "explain", "text": "Explain {attrs}."},
            {"name": "again", "continue": "explain", "text": "Once more."},
        ],
        "sampling": {"max_new_tokens": 3},  # too few for the JSON object: attrs is incomplete
        "preprocess": {"workers": 0},
        "output": {"dir": str(tmp_path / "out")},
    }
    cfg = job_config_from_dict(job)
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    rows = rows_by(tmp_path / "out" / "s.parquet")
    for key in "abc":
        assert rows[(key, "attrs")]["error_type"] == "incomplete_output"
        for name in ("explain", "again"):
            row = rows[(key, name)]
            assert (row["status"], row["error_type"]) == ("error", "dependency_failed")
            assert "prompt 'attrs'" in row["error_message"] or "prompt 'explain'" in row["error_message"]

    retry = job_config_from_dict({**job, "sampling": {"max_new_tokens": 24}})
    retry_failed(cfg, retry, ["sampling.max_new_tokens=24"], loaded=loaded_fp32, show_progress=False)
    rows = rows_by(tmp_path / "out" / "s.parquet")
    assert len(rows) == 9
    for key in "abc":
        attrs = rows[(key, "attrs")]
        assert attrs["status"] == "ok" and json.loads(attrs["text"])["n"] in range(10)
        assert rows[(key, "explain")]["status"] == "ok" and rows[(key, "again")]["status"] == "ok"


def prompts_graph(*prompts: dict) -> PromptGraph:
    base = {"model": {"path": "/m"}, "input": {"paths": ["/d"]}, "output": {"dir": "/o"}}
    return PromptGraph.of(job_config_from_dict({**base, "prompts": list(prompts)}).prompts)


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        (
            [{"name": "a", "text": "{b}"}, {"name": "b", "text": "t"}],
            "prompt 'a': {b} refers to prompt 'b', which comes later; list 'a' after 'b'",
        ),
        ([{"name": "a", "text": "again: {a}"}], "prompt 'a': {a} names the prompt itself (a prompt's"),
        (
            [{"name": "a", "text": "t"}, {"name": "b", "text": "t", "continue": "z"}],
            "prompt 'b': 'continue' names 'z', which is no prompt of this job ['a', 'b']",
        ),
        (
            [{"name": "a", "text": "t", "when": {"prompt": "b", "equals": "x"}}, {"name": "b", "text": "t"}],
            "prompt 'a': 'when' refers to prompt 'b', which comes later",
        ),
        (
            [{"name": "k", "text": "t", "choices": ["photo", "drawing"]},
             {"name": "b", "text": "t", "when": {"prompt": "k", "in": ["photo", "foto"]}}],
            "prompt 'b': 'when' tests ['foto'] but prompt 'k' answers only one of ['photo', 'drawing']",
        ),
    ],
)  # fmt: skip
def test_references_that_cannot_run_are_refused(prompts, message):
    with pytest.raises(UserError) as caught:
        prompts_graph(*prompts)
    assert message in str(caught.value)


def test_a_retry_of_a_follow_up_reruns_what_it_uses():
    graph = prompts_graph(
        {"name": "a", "text": "t"},
        {"name": "b", "text": "{a}"},
        {"name": "c", "continue": "b", "text": "t"},
        {"name": "d", "text": "t"},
    )
    assert graph.follow_ups == {1, 2}
    assert graph.with_what_they_use(frozenset({2})) == {0, 1, 2}
    assert graph.with_what_they_use(frozenset({3})) == {3}


def test_the_cli_refuses_a_forward_reference_with_exit_2(tmp_path, tiny_model_dir):
    write_job(tmp_path, tiny_model_dir)
    text = (tmp_path / "job.yaml").read_text().replace("{caption}", "{shorter}")
    (tmp_path / "job.yaml").write_text(text)
    result = batchvl("run", "job.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "prompt 'refine': {shorter} refers to prompt 'shorter', which comes later" in result.stderr
    assert not (tmp_path / "out").exists()  # refused before any work


def test_the_report_counts_skipped_rows_apart_from_errors(job_root):
    from batchvl.commands.report.page import build_report

    root, _ = job_root
    report = build_report(load_job_config(root / "job.yaml"), samples=2)
    skipped = sum(row["status"] == "skipped" for row in rows_by(root / "out" / "s.parquet").values())
    assert report.errors == 0
    assert f"skipped rows<b>{skipped}</b>" in report.html


def test_a_follow_up_with_two_inputs_waits_for_both_and_fails_with_either(
    tmp_path, tiny_model_dir, loaded_fp32
):
    """`both` inserts two outputs: it runs only once each has its row, on both texts. `mixed`'s second
    input fails where the sample's `note` is null: that fails `mixed` too, though its first input is ok."""
    (tmp_path / "data").mkdir()
    images = [png_bytes(random_image(48, 40 + 8 * i, seed=60 + i)) for i in range(3)]
    data = {"key": ["a0", "a1", "a2"], "image": images, "note": ["blue", None, "round"]}
    pq.write_table(pa.table(data), tmp_path / "data" / "s.parquet")
    job = {
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "input": {"paths": [str(tmp_path / "data" / "*.parquet")], "key_column": "key"},
        "prompts": [
            {"name": "first", "text": CAPTION},
            {"name": "second", "text": "What colour is it?"},
            {"name": "both", "text": "{first} and {second}"},
            {"name": "noted", "text": "Note: {note}"},
            {"name": "mixed", "text": "{first} and {noted}"},
        ],
        "sampling": {"max_new_tokens": NEW_TOKENS},
        "preprocess": {"workers": 0},
        "output": {"dir": str(tmp_path / "out")},
    }
    run_job(job_config_from_dict(job), loaded=loaded_fp32, show_progress=False)
    rows = rows_by(tmp_path / "out" / "s.parquet")
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    processor = reference_processor(tiny_model_dir)
    for i, key in enumerate(["a0", "a1", "a2"]):
        inputs = f"{rows[(key, 'first')]['text']} and {rows[(key, 'second')]['text']}"
        image = random_image(48, 40 + 8 * i, seed=60 + i)
        both = generate_text(model, processor, [user(inputs, image=True)], image)
        assert (rows[(key, "both")]["status"], rows[(key, "both")]["text"]) == ("ok", both)
    assert rows[("a1", "noted")]["error_type"] == "missing_field"
    mixed = rows[("a1", "mixed")]
    assert (mixed["status"], mixed["error_type"]) == ("error", "dependency_failed")
    assert "prompt 'noted', which failed (missing_field)" in mixed["error_message"]
    assert rows[("a0", "mixed")]["status"] == rows[("a2", "mixed")]["status"] == "ok"
