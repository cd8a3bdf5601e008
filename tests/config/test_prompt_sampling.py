"""A prompt's own sampling (`prompts[].sampling`): any key of the `sampling` section, read and checked as that
key is, in place of the job-wide value for that prompt's requests, on the built-in engine and on a server."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.config import job_config_from_dict, output_definition, split_definition
from batchvl.errors import ConfigError
from batchvl.pipeline.runner import run_job
from tests import server_jobs
from tests.conftest import TEST_DEVICE, output_rows, png_bytes, random_image, write_image_shards
from tests.fake_openai_server import FakeOpenAIServer
from tests.test_cli import batchvl

SHARD_SIZES = [3, 2]
SAMPLES = sum(SHARD_SIZES)
BASE = {"model": {"path": "/m"}, "input": {"paths": ["/d/*.parquet"]}, "output": {"dir": "/o"}}


def job(model_dir, root, out: str, prompts: list[dict], **sampling) -> dict:
    return {
        "model": {"path": str(model_dir), "dtype": "float32", "device": TEST_DEVICE},
        "input": {"paths": [str(root / "data" / "*.parquet")], "key_column": "key"},
        "prompts": prompts,
        # ignore_eos: every output is as long as its limit, whatever the random model writes
        "sampling": {"max_new_tokens": 6, "ignore_eos": True, **sampling},
        "preprocess": {"workers": 0},
        "output": {"dir": str(root / out)},
    }


def rows(root, out: str) -> list[dict]:
    return output_rows(root / out, len(SHARD_SIZES))


@pytest.mark.parametrize(
    ("own", "message"),
    [
        ({"temprature": 0.7}, "unknown key 'prompts[1].sampling.temprature' (did you mean "),
        ({"top_p": 1.5}, "'prompts[1].sampling.top_p' must be in (0, 1], got 1.5"),
        ({"max_new_tokens": 0}, "'prompts[1].sampling.max_new_tokens' must be positive, got 0"),
        ({"max_new_tokens": "many"}, "'prompts[1].sampling.max_new_tokens' must be an integer, got 'many'"),
        ({"stop": "END"}, "'prompts[1].sampling.stop' must be a list, got 'END'"),
        ([0.7], "'prompts[1].sampling' must be a mapping of keys, got list"),
    ],
)
def test_a_mistake_in_a_prompts_sampling_is_a_one_line_config_error(own, message):
    prompts = [{"name": "a", "text": "t"}, {"name": "b", "text": "u", "sampling": own}]
    with pytest.raises(ConfigError) as info:
        job_config_from_dict({**BASE, "prompts": prompts})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_validate_refuses_it_with_exit_2_before_any_work(tmp_path, tiny_model_dir):
    (tmp_path / "job.yaml").write_text(
        f"model: {{path: {tiny_model_dir}}}\ninput: {{paths: [data/*.parquet]}}\noutput: {{dir: out}}\n"
        "prompts: [{name: a, text: t, sampling: {temperature: -1}}]\n"
    )
    for command in ("validate", "run"):
        done = batchvl(command, "job.yaml", cwd=tmp_path)
        assert (done.returncode, done.stderr.strip().splitlines()) == (
            2,
            ["error: 'prompts[0].sampling.temperature' must be >= 0, got -1.0"],
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.yaml"]


def test_a_prompts_own_keys_take_the_place_of_the_job_wide_ones_and_the_rest_stay_the_jobs():
    prompts = [
        {"name": "a", "text": "t", "sampling": {"temperature": 1, "stop": ["."]}},
        {"name": "b", "text": "u"},
    ]
    cfg = job_config_from_dict({**BASE, "prompts": prompts, "sampling": {"max_new_tokens": 9, "top_k": 5}})
    own, job_wide = cfg.prompt_samplings
    assert job_wide == cfg.sampling
    assert (own.temperature, own.stop, own.max_new_tokens, own.top_k) == (1.0, ["."], 9, 5)
    assert isinstance(own.temperature, float)  # read as the section's key is


def test_what_defines_a_prompts_rows_is_the_sampling_it_takes():
    def definitions(prompts: list[dict], **sampling) -> dict[str, dict]:
        cfg = job_config_from_dict({**BASE, "prompts": prompts, "sampling": sampling})
        return split_definition(output_definition(cfg)[0])[1]

    caption, kind = {"name": "caption", "text": "t"}, {"name": "kind", "text": "k", "choices": ["x", "y"]}
    before = definitions([caption, kind])
    # The job's own values set in a prompt, a newer key at its default: the same rows.
    same = {**caption, "sampling": {"max_new_tokens": 128, "logprobs": False}}
    assert definitions([same, kind]) == before
    # A job-wide change is one of the prompts that take it: not of one that sets that key itself, nor of
    # a scored choices prompt, which samples nothing; log-probabilities add its columns.
    changed = definitions([caption, kind], temperature=0.5)
    assert changed["caption"] != before["caption"] and changed["kind"] == before["kind"]
    kept = {**caption, "sampling": {"temperature": 0.0}}
    assert definitions([kept, kind], temperature=0.5)["caption"] == before["caption"]
    assert definitions([caption, kind], logprobs=True)["kind"] != before["kind"]


def test_a_prompts_own_token_limit_column_is_its_own_and_a_bad_cell_fails_that_prompt_alone(
    tmp_path, loaded_fp32
):
    (tmp_path / "data").mkdir()
    images = [png_bytes(random_image(40, 48 + 4 * i, seed=i)) for i in range(2)]
    table = pa.table({"key": ["a", "b"], "image": images, "budget": [2, 0]})
    pq.write_table(table, tmp_path / "data" / "part-0.parquet")
    prompts = [
        {"name": "caption", "text": "Describe this image.", "sampling": {"max_new_tokens_field": "budget"}},
        {"name": "short", "text": "One word."},
    ]
    cfg = job_config_from_dict(job(loaded_fp32.path, tmp_path, "out", prompts))
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    got = [
        (r["key"], r["prompt"], r["status"], r["error_type"], r["num_output_tokens"])
        for r in output_rows(tmp_path / "out", 1)
    ]
    assert got == [
        ("a", "caption", "ok", None, 2),
        ("a", "short", "ok", None, 6),
        ("b", "caption", "error", "missing_field", 0),
        ("b", "short", "ok", None, 6),
    ]


def test_a_prompts_token_limit_is_its_own_and_its_rows_equal_a_job_with_that_limit_job_wide(
    tmp_path, loaded_fp32
):
    write_image_shards(tmp_path / "data", SHARD_SIZES)
    short = {"name": "short", "text": "One word.", "sampling": {"max_new_tokens": 2}}
    caption = {"name": "caption", "text": "Describe this image."}
    cfg = job_config_from_dict(job(loaded_fp32.path, tmp_path, "own", [caption, short]))
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    got = rows(tmp_path, "own")
    assert [r["num_output_tokens"] for r in got] == [6, 2] * SAMPLES
    card = (tmp_path / "own" / "README.md").read_text()  # the dataset card says so
    assert "Prompts with their own sampling:\n- `short`: max_new_tokens 2\n" in card

    job_wide = {"name": "short", "text": "One word."}
    two = job_config_from_dict(
        job(loaded_fp32.path, tmp_path, "job-wide", [caption, job_wide], max_new_tokens=2)
    )
    run_job(two, loaded=loaded_fp32, show_progress=False)
    assert [r for r in got if r["prompt"] == "short"] == [
        r for r in rows(tmp_path, "job-wide") if r["prompt"] == "short"
    ]


def test_a_prompts_own_log_probabilities_are_its_rows_alone(tmp_path, loaded_fp32):
    write_image_shards(tmp_path / "data", SHARD_SIZES)
    prompts = [
        {"name": "caption", "text": "Describe this image."},
        {"name": "short", "text": "One word.", "sampling": {"logprobs": True}},
    ]
    run_job(
        job_config_from_dict(job(loaded_fp32.path, tmp_path, "out", prompts)),
        loaded=loaded_fp32,
        show_progress=False,
    )
    got = rows(tmp_path, "out")
    assert all(r["mean_logprob"] is None for r in got if r["prompt"] == "caption")
    assert all(r["mean_logprob"] < 0 for r in got if r["prompt"] == "short")


def test_on_the_openai_backend_each_prompts_requests_carry_its_own_sampling(tmp_path, tiny_model_dir):
    prompts = [
        {"name": "caption", "text": "Describe {key}."},
        {
            "name": "short",
            "text": "One word for {key}.",
            "sampling": {"max_new_tokens": 3, "temperature": 0.5},
        },
    ]
    with FakeOpenAIServer(str(tiny_model_dir)) as server:
        path = server_jobs.write_job(tmp_path, tiny_model_dir, server_jobs.at(server.url), prompts=prompts)
        server_jobs.run(path)
    sent = {
        (kind, body["max_tokens"], body.get("temperature"))
        for kind in ("Describe", "One word for")
        for body in (r.body for r in server.completions(kind))
    }
    assert sent == {("Describe", 6, 0.0), ("One word for", 3, 0.5)}
    assert len(server_jobs.rows_by_request(tmp_path)) == 2 * SAMPLES
