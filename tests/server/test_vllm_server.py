"""The openai backend against a real vLLM server: the same job gives the built-in engine's rows.

Greedy fp32 text is compared row by row with the built-in engine's on the same data (which equals
transformers' `generate`, tests/engine/): free text cut by its token limit, a follow-up that continues the
conversation, a JSON schema whose properties are not alphabetical, and scored choices, whose
probabilities come from the server's teacher-forced `prompt_logprobs`.
"""

from __future__ import annotations

import io
import json
import math
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

import batchvl
from tests.conftest import png_bytes, random_image, write_image_shards
from tests.server.conftest import server_job

# The first test also builds the model's checkpoint and starts the server (up to 600 s on two cores)
pytestmark = pytest.mark.timeout(1500)

PROMPTS = """\
  - {name: caption, text: Describe this image.}
  - {name: more, text: Tell me more., continue: caption}
  - {name: short, text: "One word about {key}."}
"""

SCHEMA = {
    "type": "object",
    "properties": {  # not alphabetical: the model must write zeta first
        "zeta": {"type": "string", "maxLength": 4},
        "alpha": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["zeta", "alpha"],
    "additionalProperties": False,
}
LABEL_PROMPTS = f"""\
  - name: label
    text: Label this image as JSON.
    json_schema: {json.dumps(SCHEMA)}
  - name: kind
    text: Photo or drawing?
    choices: [photo, drawing, screenshot]
"""
REGEX_PROMPTS = """\
  - {name: answer, text: "Is this a photo?", regex: "(yes|no)"}
"""
COMPARED = ["key", "prompt", "status", "error_type", "text", "finish_reason", "num_prompt_tokens"]
COMPARED += ["num_output_tokens"]


def jpeg(seed: int, orientation: int = 1) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buffer = io.BytesIO()
    random_image(52, 70, seed=seed).save(buffer, format="JPEG", quality=90, exif=exif)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def data_root(tmp_path_factory) -> Path:
    """PNGs, JPEGs (sent as their own bytes) and a JPEG turned by its EXIF orientation (sent as batchvl's
    upright PNG)."""
    root = tmp_path_factory.mktemp("server-data")
    write_image_shards(
        root / "data", [3, 2, 3], replaced={(0, 1): jpeg(1), (1, 0): jpeg(2, 6), (2, 2): jpeg(3)}
    )
    return root


def run_both(root: Path, model: Path, url: str, prompts: str, sampling: str = "max_new_tokens: 12") -> tuple:
    """The rows of the same job on the built-in engine and on the server, in the same order."""
    rows = []
    for name, server in (("builtin", None), ("server", url)):
        job = root / f"{name}.yaml"
        out = root / f"out-{name}"
        job.write_text(server_job(model, server, prompts, out=str(out), sampling=sampling))
        shutil.rmtree(out, ignore_errors=True)
        batchvl.run(job, progress=False)
        rows.append(batchvl.read_results(job).to_list())
    return rows[0], rows[1]


def compared(rows: list[dict]) -> list[list]:
    return [[row[column] for column in COMPARED] for row in rows]


def test_greedy_text_equals_the_builtin_engines_on_the_same_rows(data_root, vllm_model, vllm_server):
    builtin, served = run_both(data_root, vllm_model, vllm_server.url, PROMPTS)
    assert len(served) == 8 * 3
    assert [r["status"] for r in served] == ["ok"] * len(served)
    assert {r["finish_reason"] for r in served} == {"length"}  # every output cut by its budget
    assert compared(served) == compared(builtin)


def test_labels_equal_the_builtin_engines_and_keep_the_schemas_property_order(
    data_root, vllm_model, vllm_server
):
    builtin, served = run_both(data_root, vllm_model, vllm_server.url, LABEL_PROMPTS, "max_new_tokens: 24")
    labels = [r for r in served if r["prompt"] == "label"]
    assert [r["status"] for r in labels] == ["ok"] * 8
    for row in labels:
        assert list(json.loads(row["text"])) == ["zeta", "alpha"]
    assert compared(served) == compared(builtin)
    for ours, theirs in zip(builtin, served, strict=True):
        if ours["prompt"] == "kind":
            assert dict(theirs["choice_probs"]) == pytest.approx(dict(ours["choice_probs"]), abs=1e-3)


def test_a_request_the_server_rejects_is_an_error_row_and_the_others_are_ok(
    tmp_path, vllm_model, vllm_server
):
    (tmp_path / "data").mkdir()
    images = [png_bytes(random_image(48, 64, seed=i)) for i in range(3)]
    # The middle sample asks for more tokens than the server's context holds: vLLM answers 400.
    table = pa.table({"key": ["a", "b", "c"], "image": images, "limit": [4, 100_000, 4]})
    pq.write_table(table, tmp_path / "data" / "part-0.parquet")
    job = tmp_path / "job.yaml"
    prompts = "  - {name: caption, text: Describe this image.}\n"
    sampling = "max_new_tokens: 4, max_new_tokens_field: limit"
    job.write_text(
        server_job(vllm_model, vllm_server.url, prompts, out=str(tmp_path / "out"), sampling=sampling)
    )
    batchvl.run(job, progress=False)
    rows = {r["key"]: r for r in batchvl.read_results(job).to_list()}
    assert rows["a"]["status"] == rows["c"]["status"] == "ok"
    assert rows["b"]["status"] == "error" and rows["b"]["error_type"] == "server_rejected"
    assert "4096" in rows["b"]["error_message"]  # the server's own words: its context length


def test_log_probabilities_under_a_regex_mean_what_the_builtin_engine_writes(
    data_root, vllm_model, vllm_server
):
    """vLLM 0.32 takes a constrained prompt's log-probabilities after the grammar's mask, as the built-in
    engine does: the same values for the tokens the regex allows, and -inf for those it forbids (vLLM's
    -9999.0 written as the built-in engine writes it)."""
    sampling = "max_new_tokens: 4, logprobs: true, top_logprobs: 5"
    builtin, served = run_both(data_root, vllm_model, vllm_server.url, REGEX_PROMPTS, sampling)
    assert compared(served) == compared(builtin)
    forbidden = 0
    for ours, theirs in zip(builtin, served, strict=True):
        assert theirs["status"] == "ok" and theirs["text"] in ("yes", "no")
        # fp32 on both, summed in other orders: about 1e-3 apart. Taken before the mask, a value would
        # differ by the log of the mass the regex forbids, whole nats here.
        for column in ("mean_logprob", "min_logprob"):
            assert theirs[column] == pytest.approx(ours[column], abs=1e-2)
        assert len(theirs["top_logprobs"]) == len(ours["top_logprobs"])
        for our_top, their_top in zip(ours["top_logprobs"], theirs["top_logprobs"], strict=True):
            # the allowed tokens, by id, with their values; forbidden ones tie at -inf in any order
            allowed = {c["token_id"]: c["logprob"] for c in our_top if c["logprob"] != -math.inf}
            assert {c["token_id"] for c in their_top if c["logprob"] != -math.inf} == set(allowed)
            for candidate in their_top:
                if candidate["token_id"] in allowed:
                    assert candidate["logprob"] == pytest.approx(allowed[candidate["token_id"]], abs=1e-2)
            inf = [c["logprob"] for c in their_top if c["token_id"] not in allowed]
            assert inf == [-math.inf] * (len(our_top) - len(allowed))
            forbidden += len(inf)
    assert forbidden  # the regex leaves fewer than five tokens somewhere: the -inf case is exercised
