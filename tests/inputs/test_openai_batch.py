"""OpenAI batch JSONL in and out: each line runs with its own messages and sampling and equals transformers
`generate` on the same conversation; lines that cannot run as asked are error rows of their own type; the
output file has the batch API's shape; the reader streams."""

import base64
import json
import tracemalloc

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl import api
from batchvl.commands.retry import retry_failed
from batchvl.config import InputConfig, job_config_from_dict
from batchvl.inputs.openai_batch import OpenAIBatchSource, parse_line
from batchvl.inputs.types import Sample, ShardInfo
from batchvl.pipeline.runner import run_job
from batchvl.preprocess.prompts import PromptRenderer
from batchvl.preprocess.sample import SampleProcessor
from tests.conftest import png_bytes, random_image, reference_processor, write_image_shards
from tests.http_server import LoopbackServer
from tests.test_cli import batchvl

IMAGES = [random_image(40, 56, 50), random_image(64, 48, 51), random_image(48, 48, 52)]
SCHEMA = {
    "type": "object",
    "properties": {"color": {"type": "string", "maxLength": 12}},
    "required": ["color"],
    "additionalProperties": False,
}


EMBEDDINGS = json.dumps({"custom_id": "embed", "url": "/v1/embeddings", "body": {"input": "x"}})
AUDIO = {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}


def data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def line(custom_id: str, messages: list, **body) -> str:
    record = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions"}
    return json.dumps({**record, "body": {"model": "any", "messages": messages, **body}})


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def user(text: str, *urls: str) -> dict:
    return {"role": "user", "content": [*(image_part(u) for u in urls), {"type": "text", "text": text}]}


def hf_user(text: str, images: int = 0) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * images + [{"type": "text", "text": text}]}


def read_requests(path, keep=lambda index: True) -> list[Sample]:
    source = OpenAIBatchSource(InputConfig(paths=[str(path)], format="openai_batch"))
    return [
        item for item in source.iter_shard(ShardInfo("f", str(path), None), keep) if isinstance(item, Sample)
    ]


def batch_output(path) -> list[dict]:
    return [json.loads(text) for text in path.read_text().splitlines()]


def generate_text(model, processor, messages: list[dict], images: list, max_new_tokens: int) -> str:
    rendered = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[rendered], images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@pytest.mark.parametrize(
    ("text", "error_type", "words"),
    [
        ("{not json", "bad_request", "line 7 is not JSON"),
        (json.dumps({"body": {"messages": []}}), "bad_request", "custom_id"),
        (EMBEDDINGS, "unsupported_request", "/v1/embeddings"),
        (line("x", []), "bad_request", "non-empty list"),
        (line("x", [{"role": "user", "content": [AUDIO]}]), "unsupported_request", "input_audio"),
        (line("x", [user("hi")], n=2), "unsupported_request", "body.n"),
        (line("x", [user("hi")], tools=[{"type": "function"}]), "unsupported_request", "tool calls"),
        (line("x", [user("hi")], max_tokens=0), "bad_request", "max_tokens"),
        (line("x", [user("hi")], temperature=3), "bad_request", "temperature"),
        (line("x", [user("hi", "ftp://host/a.png")]), "unsupported_request", "object-store"),
        (line("x", [user("hi", "data:image/png;base64,***")]), "bad_request", "base64"),
        (line("x", [user("hi")], response_format={"type": "grammar"}), "unsupported_request", "grammar"),
        (line("x", [{"role": "robot", "content": "hi"}]), "bad_request", "role"),
        (line("x", [user("hi")], logprobs=True), "unsupported_request", "body.logprobs: log-probabilities"),
        (line("x", [user("hi")], top_logprobs=2), "unsupported_request", "body.top_logprobs: log-prob"),
    ],
)  # fmt: skip
def test_lines_that_cannot_run_as_asked_are_errors_of_their_own_type(text, error_type, words):
    sample = parse_line("s.jsonl", 0, 7, text)
    assert sample.error is not None and sample.error.error_type == error_type
    assert words in sample.error.message


def test_a_line_that_does_not_ask_for_log_probabilities_runs():
    sample = parse_line("s.jsonl", 0, 7, line("x", [user("hi")], logprobs=False, top_logprobs=0))
    assert sample.error is None and sample.chat is not None


def test_a_line_becomes_its_messages_media_and_sampling():
    text = line(
        "req-1",
        [{"role": "system", "content": "Be brief."}, user("What is here?", data_uri(IMAGES[0]))],
        max_completion_tokens=7,
        temperature=0.5,
        top_p=0.9,
        stop=["."],
        seed=3,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": SCHEMA, "strict": True},
        },
    )
    sample = parse_line("s.jsonl", 4, 5, text)
    assert sample.error is None and (sample.key, sample.index) == ("req-1", 4)
    assert [ref.data for ref in sample.images] == [png_bytes(IMAGES[0])]
    chat = sample.chat
    assert chat.messages[0] == {"role": "system", "content": [{"type": "text", "text": "Be brief."}]}
    assert chat.messages[1]["content"] == [{"type": "image"}, {"type": "text", "text": "What is here?"}]
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.stop, chat.seed) == (7, 0.5, 0.9, (".",), 3)
    assert chat.json_schema == SCHEMA
    assert parse_line(
        "s", 0, 1, line("j", [user("x")], response_format={"type": "json_object"})
    ).chat.json_schema == {"type": "object"}


def test_max_completion_tokens_wins_over_max_tokens():
    for body in (
        {"max_tokens": 50, "max_completion_tokens": 7},
        {"max_completion_tokens": 7, "max_tokens": 50},
    ):
        assert parse_line("s", 0, 1, line("x", [user("hi")], **body)).chat.max_tokens == 7


def test_a_developer_message_is_rendered_as_the_system_turn(loaded_fp32):
    text = line("d", [{"role": "developer", "content": "Answer briefly."}, user("What is two plus two?")])
    prepared = SampleProcessor(PromptRenderer(loaded_fp32.processor), None, [])(parse_line("s", 0, 1, text))
    by_hand = loaded_fp32.processor.tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "What is two plus two?"},
        ],
        add_generation_prompt=True,
        tokenize=True,
    )["input_ids"]
    assert prepared.error is None and prepared.prompts[0].prompt == by_hand


def test_a_utf8_bom_before_the_first_line_is_not_part_of_it(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + line("first", [user("hi")], max_tokens=2).encode() + b"\n")
    assert [(s.key, s.error, s.chat.max_tokens) for s in read_requests(path)] == [("first", None, 2)]


def test_a_carriage_return_inside_a_line_is_whitespace_not_a_line_break(tmp_path):
    first = line("first", [user("hi")], max_tokens=2).replace(', "body"', ',\r"body"')
    assert "\r" in first
    path = tmp_path / "r.jsonl"
    path.write_bytes(f"{first}\r\n{line('second', [user('yo')])}\r\n".encode())
    assert [(s.key, s.error) for s in read_requests(path)] == [("first", None), ("second", None)]


def test_a_repeated_custom_id_is_an_error_row_naming_the_line_that_has_it_first(tmp_path):
    path = tmp_path / "r.jsonl"
    texts = [line("a", [user("x")]), line("b", [user("x")]), line("a", [user("y")]), "{broken", line("a", [])]
    path.write_text("\n".join(texts) + "\n")
    samples = read_requests(path)
    assert [(s.key, s.error and s.error.error_type) for s in samples] == [
        ("a", None),
        ("b", None),
        ("a", "bad_request"),
        ("line-4", "bad_request"),
        ("a", "bad_request"),
    ]
    for repeated in (samples[2], samples[4]):
        assert "custom_id 'a' is already line 1's" in repeated.error.message
    # a retry that reads only the last line still knows the first one has its id
    (last,) = read_requests(path, keep=lambda index: index == 4)
    assert last.index == 4 and "already line 1's" in last.error.message


def test_data_images_wrapped_in_lines_or_in_url_safe_base64_decode_to_their_bytes():
    data = png_bytes(IMAGES[2])
    standard = base64.b64encode(data).decode()
    assert "+" in standard and "/" in standard and standard.endswith("=")  # url-safe differs, unpadded too
    payloads = [
        base64.encodebytes(data).decode(),  # MIME: lines of 76 characters
        base64.encodebytes(data).decode().replace("\n", "\r\n"),
        base64.urlsafe_b64encode(data).decode(),
        base64.urlsafe_b64encode(data).decode().rstrip("="),
    ]
    for payload in payloads:
        sample = parse_line("s", 0, 1, line("x", [user("hi", "data:image/png;base64," + payload)]))
        assert sample.error is None and [ref.data for ref in sample.images] == [data]


def test_a_file_of_10000_requests_is_read_in_the_memory_of_one(tmp_path):
    def peak_while_reading(count: int) -> tuple[int, int]:
        path = tmp_path / f"{count}.jsonl"
        uri = data_uri(IMAGES[1])
        path.write_text("".join(line(f"r{i}", [user("Describe.", uri)]) + "\n" for i in range(count)))
        source = OpenAIBatchSource(InputConfig(paths=[str(path)], format="openai_batch"))
        tracemalloc.start()
        seen = sum(1 for _ in source.iter_shard(ShardInfo("f", str(path), None), lambda i: True))
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return seen, peak

    small, large = peak_while_reading(100), peak_while_reading(10_000)
    assert (small[0], large[0]) == (101, 10_001)  # every request, then the shard's end
    assert large[1] < 2 * small[1] + 100_000  # the file is 100x larger: its size never sits in memory


def test_a_batch_file_runs_each_request_as_asked_and_writes_the_batch_output(tmp_path, tiny_model_dir):
    with LoopbackServer() as server:
        url = server.add_image("c.png", png_bytes(IMAGES[2]))
        conversation = [
            {"role": "system", "content": "You label pictures."},
            user("Describe this image.", data_uri(IMAGES[1])),
            {"role": "assistant", "content": "A picture."},
            {"role": "user", "content": "Say more."},
        ]
        lines = [
            line("single", [user("Describe this image.", data_uri(IMAGES[0]))], max_tokens=5),
            line("multi-turn", conversation, max_tokens=4),
            "{broken",
            line("by-url", [user("What is this?", url)], max_tokens=6),
            EMBEDDINGS,
            line("labelled", [user("Name its color.", data_uri(IMAGES[0]))], max_tokens=40,
                 response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}),
        ]  # fmt: skip
        (tmp_path / "requests").mkdir()
        (tmp_path / "requests" / "batch-1.jsonl").write_text("\n".join(lines) + "\n\n")
        (tmp_path / "job.yaml").write_text(
            f"""
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
input: {{format: openai_batch, paths: ["requests/*.jsonl"], download: {{allow_private: true}}}}
sampling: {{max_new_tokens: 3, ignore_eos: true}}
output: {{dir: out, format: openai_batch}}
"""
        )
        done = batchvl("run", "job.yaml", cwd=tmp_path)
        assert done.returncode == 0, done.stderr

    rows = {row["key"]: row for row in pq.read_table(tmp_path / "out" / "batch-1.parquet").to_pylist()}
    assert set(rows) == {"single", "multi-turn", "line-3", "by-url", "embed", "labelled"}
    assert {k: r["error_type"] for k, r in rows.items() if r["status"] != "ok"} == {
        "line-3": "bad_request",
        "embed": "unsupported_request",
    }
    assert [rows[k]["num_output_tokens"] for k in ("single", "multi-turn", "by-url")] == [5, 4, 6]

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    processor = reference_processor(tiny_model_dir)
    expected = {
        "single": generate_text(model, processor, [hf_user("Describe this image.", 1)], [IMAGES[0]], 5),
        "multi-turn": generate_text(
            model,
            processor,
            [
                {"role": "system", "content": [{"type": "text", "text": "You label pictures."}]},
                hf_user("Describe this image.", 1),
                {"role": "assistant", "content": [{"type": "text", "text": "A picture."}]},
                hf_user("Say more."),
            ],
            [IMAGES[1]],
            4,
        ),
        "by-url": generate_text(model, processor, [hf_user("What is this?", 1)], [IMAGES[2]], 6),
    }
    for key, text in expected.items():
        assert rows[key]["text"] == text, key
    labelled = rows["labelled"]
    assert labelled["status"] == "ok", labelled["error_message"]
    assert set(json.loads(labelled["text"])) == {"color"}

    output = [
        json.loads(text) for text in (tmp_path / "out" / "batch-1.output.jsonl").read_text().splitlines()
    ]
    assert [o["custom_id"] for o in output] == [
        "single",
        "multi-turn",
        "line-3",
        "by-url",
        "embed",
        "labelled",
    ]
    first = output[0]
    assert first["error"] is None and first["id"].startswith("batch_req_")
    body = first["response"]["body"]
    assert first["response"]["status_code"] == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": expected["single"]}
    assert body["choices"][0]["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5 == rows["single"]["num_prompt_tokens"] + 5
    assert output[4]["response"] is None and output[4]["error"]["code"] == "unsupported_request"
    assert "/v1/embeddings" in output[4]["error"]["message"]


def test_prompts_beside_an_openai_batch_input_are_refused_with_exit_2(tmp_path, tiny_model_dir):
    (tmp_path / "requests").mkdir()
    (tmp_path / "requests" / "a.jsonl").write_text(line("a", [user("hi")]) + "\n")
    (tmp_path / "job.yaml").write_text(
        f"""
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
input: {{format: openai_batch, paths: ["requests/*.jsonl"]}}
prompts: [{{name: caption, text: Describe.}}]
output: {{dir: out}}
"""
    )
    done = batchvl("run", "job.yaml", cwd=tmp_path)
    assert done.returncode == 2
    assert "remove 'prompts'" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_python_api_runs_a_batch_file(tmp_path, loaded_fp32):
    (tmp_path / "requests").mkdir()
    lines = [
        line("first", [user("Describe this image.", data_uri(IMAGES[0]))], max_tokens=3),
        line("second", [user("Describe this image.", data_uri(IMAGES[1]))], max_tokens=2),
    ]
    (tmp_path / "requests" / "b.jsonl").write_text("\n".join(lines) + "\n")
    job = {
        "model": {"path": loaded_fp32.path, "dtype": "float32", "device": "cpu"},
        "input": {"format": "openai_batch", "paths": [str(tmp_path / "requests" / "*.jsonl")]},
        "sampling": {"ignore_eos": True},
        "output": {"dir": str(tmp_path / "out"), "format": "openai_batch"},
    }
    results = api.run(job, model=loaded_fp32, progress=False)
    rows = {row["key"]: row for row in results.dataset.to_list()}
    assert {key: (row["prompt"], row["num_output_tokens"]) for key, row in rows.items()} == {
        "first": ("response", 3),
        "second": ("response", 2),
    }
    output = [json.loads(text) for text in (tmp_path / "out" / "b.output.jsonl").read_text().splitlines()]
    contents = [o["response"]["body"]["choices"][0]["message"]["content"] for o in output]
    assert contents == [rows["first"]["text"], rows["second"]["text"]]
    assert api.read_results(job)["key"] == ["first", "second"]


def test_retry_failed_rewrites_the_batch_output_with_the_fixed_rows(tmp_path, loaded_fp32):
    (tmp_path / "requests").mkdir()
    labelled = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
    lines = [
        line("caption", [user("Describe this image.", data_uri(IMAGES[0]))], max_tokens=3),
        line("label", [user("Name its color.", data_uri(IMAGES[1]))], response_format=labelled),
    ]
    (tmp_path / "requests" / "r.jsonl").write_text("\n".join(lines) + "\n")
    job = {
        "model": {"path": loaded_fp32.path, "dtype": "float32", "device": "cpu"},
        "input": {"format": "openai_batch", "paths": [str(tmp_path / "requests" / "*.jsonl")]},
        "sampling": {"max_new_tokens": 2},  # the label's own limit: too few for its JSON object
        "preprocess": {"workers": 0},
        "output": {"dir": str(tmp_path / "out"), "format": "openai_batch"},
    }
    cfg = job_config_from_dict(job)
    run_job(cfg, loaded=loaded_fp32, show_progress=False)

    def written():
        text = (tmp_path / "out" / "r.output.jsonl").read_text()
        return {o["custom_id"]: o for o in map(json.loads, text.splitlines())}

    before = written()
    assert before["label"]["error"]["code"] == "incomplete_output" and before["label"]["response"] is None
    retry = job_config_from_dict({**job, "sampling": {"max_new_tokens": 40}})
    retry_failed(cfg, retry, ["sampling.max_new_tokens=40"], loaded=loaded_fp32, show_progress=False)
    after = written()
    assert list(after) == ["caption", "label"]
    # an ok row is not run again: the same line, but for the time the file was written
    for line_of in (after, before):
        line_of["caption"]["response"]["body"].pop("created")
    assert after["caption"] == before["caption"]
    assert after["label"]["error"] is None
    content = after["label"]["response"]["body"]["choices"][0]["message"]["content"]
    assert set(json.loads(content)) == {"color"}


def test_odd_but_valid_files_give_each_line_one_output_line_with_ids_unique_in_the_job(
    tmp_path, tiny_model_dir, loaded_fp32
):
    mime = "data:image/png;base64," + base64.encodebytes(png_bytes(IMAGES[0])).decode()
    url_safe = "data:image/png;base64," + base64.urlsafe_b64encode(png_bytes(IMAGES[1])).decode().rstrip("=")
    a = [
        line("first", [user("Describe this image.", mime)], max_tokens=3).replace(', "body"', ',\r"body"'),
        line("second", [user("Describe this image.", url_safe)], max_tokens=3),
        "{broken",
        line("first", [user("Say more.")], max_tokens=3),
    ]
    b = [line("second", [user("Describe this image.", url_safe)], max_tokens=3), line("third", []), "{broken"]
    (tmp_path / "requests").mkdir()
    (tmp_path / "requests" / "a.jsonl").write_bytes(("\ufeff" + "\r\n".join(a) + "\r\n").encode())
    (tmp_path / "requests" / "b.jsonl").write_text("\n".join(b) + "\n")
    job = {
        "model": {"path": loaded_fp32.path, "dtype": "float32", "device": "cpu"},
        "input": {"format": "openai_batch", "paths": [str(tmp_path / "requests" / "*.jsonl")]},
        "sampling": {"ignore_eos": True},
        "output": {"dir": str(tmp_path / "out"), "format": "openai_batch"},
    }
    api.run(job, model=loaded_fp32, progress=False)
    out_a, out_b = (batch_output(tmp_path / "out" / f"{name}.output.jsonl") for name in "ab")

    def outcomes(output):
        return [(o["custom_id"], o["error"] and o["error"]["code"]) for o in output]

    assert outcomes(out_a) == [
        ("first", None),
        ("second", None),
        ("line-3", "bad_request"),
        ("first", "bad_request"),
    ]
    assert "already line 1's" in out_a[3]["error"]["message"]
    assert outcomes(out_b) == [("second", None), ("third", "bad_request"), ("line-3", "bad_request")]
    ids = [o["id"] for o in out_a + out_b]
    assert len(set(ids)) == len(ids) == 7  # the same error (line-3), the same answer ("second") in two files

    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    processor = reference_processor(tiny_model_dir)
    content = [
        o["response"] and o["response"]["body"]["choices"][0]["message"]["content"] for o in out_a + out_b
    ]
    first = generate_text(model, processor, [hf_user("Describe this image.", 1)], [IMAGES[0]], 3)
    second = generate_text(model, processor, [hf_user("Describe this image.", 1)], [IMAGES[1]], 3)
    assert (content[0], content[1], content[4]) == (first, second, second)


def test_a_temperature_too_small_to_divide_by_runs_greedily(tmp_path, tiny_model_dir, loaded_fp32):
    """In a line's body and in the job's sampling: the row is ok and holds greedy generate's text."""
    model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    processor = reference_processor(tiny_model_dir)
    greedy = generate_text(model, processor, [hf_user("Describe this image.", 1)], [IMAGES[2]], 4)
    request = [user("Describe this image.", data_uri(IMAGES[2]))]
    for name, body, sampling in [("line", {"temperature": 1e-40}, {}), ("job", {}, {"temperature": 1e-40})]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "r.jsonl").write_text(line("cold", request, max_tokens=4, **body) + "\n")
        job = {
            "model": {"path": loaded_fp32.path, "dtype": "float32", "device": "cpu"},
            "input": {"format": "openai_batch", "paths": [str(tmp_path / name / "r.jsonl")]},
            "sampling": {"ignore_eos": True, **sampling},
            "output": {"dir": str(tmp_path / f"{name}-out")},
        }
        (row,) = api.run(job, model=loaded_fp32, progress=False).dataset.to_list()
        assert (row["status"], row["error_message"], row["text"]) == ("ok", None, greedy), name


def test_several_prompts_name_lines_key_then_prompt_and_a_skipped_one_says_why(tmp_path, loaded_fp32):
    write_image_shards(tmp_path / "data", [2])
    job = {
        "model": {"path": loaded_fp32.path, "dtype": "float32", "device": "cpu"},
        "input": {"paths": [str(tmp_path / "data" / "*.parquet")], "key_column": "key"},
        "prompts": [
            {"name": "caption", "text": "Describe this image."},
            {"name": "detail", "text": "More.", "when": {"prompt": "caption", "equals": "never said"}},
            {"name": "more", "text": "Expand on {detail}."},
        ],
        "sampling": {"max_new_tokens": 2},
        "output": {"dir": str(tmp_path / "out"), "format": "openai_batch"},
    }
    api.run(job, model=loaded_fp32, progress=False)
    output = batch_output(tmp_path / "out" / "part-0.output.jsonl")
    assert [o["custom_id"] for o in output] == [
        "s0-0:caption", "s0-0:detail", "s0-0:more", "s0-1:caption", "s0-1:detail", "s0-1:more",
    ]  # fmt: skip
    assert output[0]["error"] is None and output[0]["response"]["status_code"] == 200
    when_unmet = "not run: prompt 'detail' runs only where the output of prompt 'caption' is 'never said'"
    uses_skipped = "not run: it uses prompt 'detail', which was skipped for this sample"
    for skipped, message in [(output[1], when_unmet), (output[2], uses_skipped), (output[5], uses_skipped)]:
        assert skipped["response"] is None
        assert skipped["error"] == {"code": "skipped", "message": message}
    assert len({o["id"] for o in output}) == 6
