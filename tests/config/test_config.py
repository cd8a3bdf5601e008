import json
import re
from pathlib import Path

import pytest

from batchvl.config import (
    JobConfig,
    PromptConfig,
    config_fingerprint,
    describe_keys,
    job_config_from_dict,
    keys_markdown_table,
    load_job_config,
    output_defining_config,
)
from batchvl.errors import ConfigError

MINIMAL = """
model: {path: /models/m}
input: {paths: ["data/*.parquet"]}
output: {dir: out}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def error_of(tmp_path, text, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_job_config(write(tmp_path, text), overrides)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_minimal_job_gets_defaults_and_resolved_paths(tmp_path):
    cfg = load_job_config(write(tmp_path, MINIMAL))
    assert isinstance(cfg, JobConfig)
    assert cfg.input.paths == [str(tmp_path / "data" / "*.parquet")]
    assert cfg.output.dir == str(tmp_path / "out")
    assert cfg.model.path == "/models/m" and cfg.model.dtype == "auto"
    assert [(p.name, p.text) for p in cfg.prompts] == [("caption", "Describe this image.")]
    assert cfg.engine.max_num_seqs == "auto" and cfg.sampling.temperature == 0.0


def test_unknown_key_suggests_the_close_one(tmp_path):
    message = error_of(tmp_path, MINIMAL + "engine: {max_num_seq: 4}\n")
    assert "engine.max_num_seq" in message and "did you mean 'engine.max_num_seqs'" in message


def test_a_key_given_twice_is_refused_naming_both_lines(tmp_path):
    message = error_of(tmp_path, MINIMAL + "sampling: {max_new_tokens: 3}\nsampling: {temperature: 1}\n")
    assert message.startswith(f"{tmp_path / 'job.yaml'}: key 'sampling' is given twice (lines 5 and 6)")
    nested = MINIMAL + "engine:\n  max_num_seqs: 4\n  lookahead: 2\n  max_num_seqs: 8\n"
    assert "key 'max_num_seqs' is given twice (lines 6 and 8)" in error_of(tmp_path, nested)


def test_a_list_item_is_set_by_its_number(tmp_path):
    prompts = MINIMAL + "prompts: [{name: a, text: one}, {name: b, text: two}]\n"
    cfg = load_job_config(write(tmp_path, prompts), ["prompts[1].text=hi", "prompts[0]={name: c, text: x}"])
    assert [(p.name, p.text) for p in cfg.prompts] == [("c", "x"), ("b", "hi")]
    assert error_of(tmp_path, prompts, ["prompts[2].text=hi"]) == (
        "--set prompts[2].text: 'prompts' holds 2 item(s), numbered from 0"
    )
    assert error_of(tmp_path, MINIMAL, ["prompts[0].text=hi"]) == (
        "--set prompts[0].text: the job file has no list 'prompts'; set the whole list: prompts=[...]"
    )
    assert error_of(tmp_path, prompts, ["prompts.0.text=hi"]) == (
        "--set prompts.0.text: 'prompts' is a list; name one of its items by index, as in "
        "--set prompts[0].text=..."
    )
    assert error_of(tmp_path, prompts, ["prompts.text=hi"]) == (
        "--set prompts.text: 'prompts' is a list; name one of its items by index, as in "
        "--set prompts[0].text=..."
    )
    assert error_of(tmp_path, prompts, ["sampling={a: 1, a: 2}"]).startswith(
        "--set sampling={a: 1, a: 2}: key 'a' is given twice"
    )


def test_a_folder_or_a_device_given_as_the_job_file_is_named_so(tmp_path):
    with pytest.raises(ConfigError, match=f"^{tmp_path} is a folder; give the job file"):
        load_job_config(tmp_path)
    with pytest.raises(ConfigError, match="^/dev/null is not a regular file; give the job file"):
        load_job_config("/dev/null")


def test_unknown_section_suggests(tmp_path):
    assert "did you mean 'sampling'" in error_of(tmp_path, MINIMAL + "sampeling: {}\n")


def test_missing_required_key(tmp_path):
    assert "missing required key 'output.dir'" in error_of(
        tmp_path, MINIMAL.replace("output: {dir: out}", "output: {}")
    )


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        ("engine: {max_num_seqs: abc}", "'engine.max_num_seqs' must be int or auto, got 'abc'"),
        ("engine: {lookahead: abc}", "'engine.lookahead' must be an integer"),
        ("engine: {max_num_seqs: true}", "'engine.max_num_seqs' must be an integer"),
        ("engine: {max_num_seqs: 0}", "'engine.max_num_seqs' must be positive"),
        ("sampling: {top_p: 0}", "'sampling.top_p'"),
        ("sampling: {stop: 3}", "'sampling.stop' must be a list"),
        ("prompts: [{name: a, text: x}, {name: b, text: 5}]", "'prompts[1].text' must be a string"),
        ("prompts: [{name: a, text: x}, {name: a, text: y}]", "unique"),
        ("preprocess: {min_pixels: 10, max_pixels: 5}", "preprocess.min_pixels"),
        ("engine: 3", "'engine' must be a mapping"),
    ],
)
def test_bad_values_name_their_key(tmp_path, extra, fragment):
    assert fragment in error_of(tmp_path, MINIMAL + extra + "\n")


def test_literal_choices(tmp_path):
    message = error_of(tmp_path, MINIMAL.replace("{path: /models/m}", "{path: /m, dtype: fp16}"))
    assert "'model.dtype' must be one of float32, bfloat16, auto" in message


def test_int_is_accepted_for_float(tmp_path):
    cfg = load_job_config(write(tmp_path, MINIMAL + "sampling: {temperature: 1}\n"))
    assert cfg.sampling.temperature == 1.0 and isinstance(cfg.sampling.temperature, float)


def test_yaml_syntax_error_and_missing_file(tmp_path):
    assert "line" in error_of(tmp_path, "model: [\n")
    with pytest.raises(ConfigError, match="job file not found"):
        load_job_config(tmp_path / "nope.yaml")


def test_overrides(tmp_path):
    path = write(tmp_path, MINIMAL)
    cfg = load_job_config(
        path,
        [
            "engine.max_num_seqs=8",
            'sampling.stop=["\\n", END]',
            "prompts=[{name: q, text: why}]",
            "model.path=/x",
        ],
    )
    assert cfg.engine.max_num_seqs == 8
    assert cfg.sampling.stop == ["\n", "END"]
    assert [(p.name, p.text) for p in cfg.prompts] == [("q", "why")]
    assert cfg.model.path == "/x"
    with pytest.raises(ConfigError, match="did you mean 'engine.max_num_seqs'"):
        load_job_config(path, ["engine.max_num_sqs=8"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_job_config(path, ["engine.max_num_seqs"])


def test_fingerprint_tracks_outputs_not_engine_limits():
    base = {"model": {"path": "/m"}, "input": {"paths": ["/d/*.parquet"]}, "output": {"dir": "/o"}}
    fp = config_fingerprint(job_config_from_dict(base))
    assert fp == config_fingerprint(job_config_from_dict(base, overrides=["engine.max_num_seqs=3"]))
    assert fp != config_fingerprint(job_config_from_dict(base, overrides=["sampling.max_new_tokens=3"]))


def test_every_leaf_key_is_described_and_in_the_configuration_docs():
    import dataclasses
    import typing

    def leaves(cls, prefix=""):
        out = []
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            args = typing.get_args(tp)
            name = f.metadata["name"] or f.name  # the job file's name, where the field's is a keyword
            if dataclasses.is_dataclass(tp):
                out += leaves(tp, f"{prefix}{name}.")
            elif typing.get_origin(tp) is list and dataclasses.is_dataclass(args[0]):
                out += leaves(args[0], f"{prefix}{name}[].")
            elif args and dataclasses.is_dataclass(args[0]):  # an optional section
                out += leaves(args[0], f"{prefix}{name}.")
            else:
                out.append(prefix + name)
        return out

    described = [row[0] for row in describe_keys()]
    assert described == leaves(JobConfig)
    assert all(row[3] for row in describe_keys()), "every key needs help text"
    docs = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    table = re.search(r"<!-- keys-table:start -->\n(.*)\n<!-- keys-table:end -->", docs, re.S).group(1)
    assert table == keys_markdown_table(), (
        "the key table in docs/configuration.md is stale: regenerate it from keys_markdown_table()"
    )


def test_the_output_defining_keys_are_exactly_these():
    # Changing this set changes every fingerprint: committed outputs would be refused as another config.
    cfg = job_config_from_dict({"model": {"path": "/m"}, "input": {"paths": ["/d"]}, "output": {"dir": "/o"}})
    defining = output_defining_config(cfg)
    assert {section: sorted(keys) for section, keys in defining.items() if isinstance(keys, dict)} == {
        "model": ["dtype", "path", "trust_remote_code"],
        "input": ["files_per_shard", "format", "image_column", "key_column", "root"],
        "sampling": sorted(
            ["max_new_tokens", "max_new_tokens_field", "temperature", "top_p", "top_k", "seed", "stop"]
            + ["stop_token_ids", "ignore_eos"]
        ),
        "preprocess": sorted(
            ["min_pixels", "max_pixels", "max_image_pixels", "video_fps", "video_min_frames"]
            + ["video_max_frames", "video_max_pixels"]
        ),
    }
    assert defining["prompts"] == [{"name": "caption", "text": "Describe this image."}]


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("sampling.top_p=1.5", "'sampling.top_p' must be in (0, 1], got 1.5"),
        ("output.max_error_rate=-0.1", "'output.max_error_rate' must be in [0, 1], got -0.1"),
        ("engine.lookahead=0", "'engine.lookahead' must be positive, got 0"),
        ("preprocess.video_fps=0", "'preprocess.video_fps' must be positive, got 0"),
        ("engine.vit_parallel=model", "'engine.vit_parallel' must be one of none, data"),
    ],
)
def test_bounds_are_declared_on_the_keys(tmp_path, override, fragment):
    assert fragment in error_of(tmp_path, MINIMAL, [override])


def test_a_constraint_enters_the_fingerprint_and_its_absence_keeps_the_old_one():
    base = {"model": {"path": "/m"}, "input": {"paths": ["/d"]}, "output": {"dir": "/o"}}
    free = job_config_from_dict({**base, "prompts": [{"name": "kind", "text": "t"}]})
    # the fingerprints these jobs had before prompts could carry constraints (computed by that version)
    assert config_fingerprint(free) == "7193e418a0e63948"
    assert config_fingerprint(job_config_from_dict(base)) == "66c4d6f4312b8b0d"
    choices = job_config_from_dict(
        {**base, "prompts": [{"name": "kind", "text": "t", "choices": ["a", "b"]}]}
    )
    other = job_config_from_dict({**base, "prompts": [{"name": "kind", "text": "t", "choices": ["a", "c"]}]})
    assert len({config_fingerprint(free), config_fingerprint(choices), config_fingerprint(other)}) == 3


def test_a_schemas_property_order_defines_the_output():
    base = {"model": {"path": "/m"}, "input": {"paths": ["/d"]}, "output": {"dir": "/o"}}

    def fingerprint(schema: dict) -> str:
        prompt = {"name": "p", "text": "t", "json_schema": schema}
        return config_fingerprint(job_config_from_dict({**base, "prompts": [prompt]}))

    alphabetical = {
        "type": "object",
        "properties": {"color": {"type": "string"}, "count": {"type": "integer"}},
    }
    # the fingerprint this job had when the grammar sorted the properties (computed by that version): a
    # schema whose properties are alphabetical writes the same rows as before, so keeps its shards
    assert fingerprint(alphabetical) == "e0b69c7c5c0195d2"
    assert fingerprint({"properties": alphabetical["properties"], "type": "object"}) == "e0b69c7c5c0195d2"
    reordered = {"type": "object", "properties": {"count": {"type": "integer"}, "color": {"type": "string"}}}
    nested = {
        "type": "object",
        "properties": {"a": {"type": "object", "properties": reordered["properties"]}},
    }
    nested_sorted = {"type": "object", "properties": {"a": alphabetical}}
    assert (
        len(
            {
                fingerprint(alphabetical),
                fingerprint(reordered),
                fingerprint(nested),
                fingerprint(nested_sorted),
            }
        )
        == 4
    )


def test_a_json_schema_path_is_read_relative_to_the_job_file(tmp_path):
    (tmp_path / "schemas").mkdir()
    (tmp_path / "schemas" / "a.json").write_text('{"type": "object"}')
    (tmp_path / "schemas" / "broken.json").write_text('{"type": ')
    base = "model: {path: /m}\ninput: {paths: [/d]}\noutput: {dir: /o}\n"
    job = tmp_path / "job.yaml"
    job.write_text(base + "prompts: [{name: p, text: t, json_schema: schemas/a.json}]\n")
    assert load_job_config(job).prompts[0].json_schema == {"type": "object"}
    for path, fragment in [
        ("schemas/broken.json", "is not valid JSON"),
        ("schemas/none.json", "cannot be read"),
    ]:
        job.write_text(base + f"prompts: [{{name: p, text: t, json_schema: {path}}}]\n")
        with pytest.raises(ConfigError, match=f"prompt 'p': json_schema {path} {fragment}"):
            load_job_config(job)


@pytest.mark.parametrize(
    ("prompt", "fragment"),
    [
        ({"choices": []}, "'choices' must list at least one non-empty string"),
        ({"choices": ["a", ""]}, "'choices' must list at least one non-empty string"),
        ({"choices": ["a", "b", "a"]}, "'choices' holds a choice twice"),
        ({"regex": "a", "json_schema": {"type": "string"}}, "has json_schema and regex; keep one"),
        ({"json_whitespace": "any"}, "'json_whitespace' applies to a json_schema prompt"),
        ({"choice_mode": "generate"}, "'choice_mode' applies to a choices prompt"),
        ({"json_schema": 3}, "'prompts[0].json_schema' must be dict or str, got 3"),
    ],
)
def test_constraint_key_mistakes_name_the_prompt(prompt, fragment):
    base = {"model": {"path": "/m"}, "input": {"paths": ["/d"]}, "output": {"dir": "/o"}}
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        job_config_from_dict({**base, "prompts": [{"name": "p", "text": "t", **prompt}]})


def python_built(**sections) -> JobConfig:
    """A JobConfig made from its dataclasses, as a notebook or script would, without the job-file loader."""
    from batchvl.config import InputConfig, ModelConfig, OutputConfig

    base = dict(model=ModelConfig(path="/models/m"), input=InputConfig(paths=["/d/*.parquet"]))
    return JobConfig(**{**base, "output": OutputConfig(dir="/o"), **sections})


@pytest.mark.parametrize(
    ("override", "built"),
    [
        ("engine.max_num_seqs=0", lambda c: python_built(engine=c.EngineConfig(max_num_seqs=0))),
        ("sampling.top_p=1.5", lambda c: python_built(sampling=c.SamplingConfig(top_p=1.5))),
        ("sampling.max_new_tokens=true", lambda c: python_built(
            sampling=c.SamplingConfig(max_new_tokens=True))),
        ("engine.vit_parallel=model", lambda c: python_built(engine=c.EngineConfig(vit_parallel="model"))),
        ("input.download.retries=-1", lambda c: python_built(
            input=c.InputConfig(paths=["/d/*.parquet"], download=c.DownloadConfig(retries=-1)))),
        ("preprocess.min_pixels=100", lambda c: python_built(
            preprocess=c.PreprocessConfig(min_pixels=100, max_pixels=50))),
        ("prompts=[]", lambda c: python_built(prompts=[])),
        ("prompts=[{name: a, text: t}, {name: a, text: u}]", lambda c: python_built(
            prompts=[c.PromptConfig(name="a", text="t"), c.PromptConfig(name="a", text="u")])),
        ("prompts=[{name: p, text: t, regex: a, choices: [a]}]", lambda c: python_built(
            prompts=[c.PromptConfig(name="p", text="t", regex="a", choices=["a"])])),
        ("prompts=[{name: p, text: 3}]", lambda c: python_built(prompts=[c.PromptConfig(name="p", text=3)])),
        ("sampling.stop=a", lambda c: python_built(sampling=c.SamplingConfig(stop="a"))),
    ],
)  # fmt: skip
def test_a_config_built_in_python_is_refused_with_the_job_files_message(tmp_path, override, built):
    import batchvl.config as c

    if override.startswith("preprocess.min_pixels"):  # two keys: the job file sets both
        yaml_message = error_of(tmp_path, MINIMAL, [override, "preprocess.max_pixels=50"])
    else:
        yaml_message = error_of(tmp_path, MINIMAL, [override])
    with pytest.raises(ConfigError) as python:
        built(c)
    assert str(python.value) == yaml_message


def test_a_config_built_in_python_gets_its_paths_and_schema_read_by_the_api(tmp_path, monkeypatch):
    from batchvl.api import _job_config

    (tmp_path / "s.json").write_text('{"type": "object"}')
    monkeypatch.chdir(tmp_path)
    cfg = python_built(prompts=[PromptConfig(name="p", text="t", json_schema="s.json")])
    resolved = _job_config(cfg, [])
    assert resolved.prompts[0].json_schema == {"type": "object"}
    assert resolved.input.paths == ["/d/*.parquet"] and resolved.output.dir == "/o"


def test_the_readmes_table_of_common_keys_gives_their_declared_defaults():
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme[readme.index("The keys most jobs set:") :]
    rows = re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", section.split("\n\n")[1], re.M)[1:]  # past the header
    declared = {key: default for key, _, default, _ in describe_keys()}
    assert len(rows) >= 10
    for keys, defaults in rows:
        names = re.findall(r"`([^`]+)`", keys)
        written = [d.strip().strip("`") for d in defaults.split(",")]
        written = written * len(names) if len(written) == 1 else written  # one default for the row
        for name, default in zip(names, written, strict=True):
            value = declared[name] if declared[name] == "required" else json.loads(declared[name])
            assert default == ("null" if value is None else str(value)), name


def test_a_yaml_date_is_read_as_the_text_it_was_written_as(tmp_path):
    message = error_of(tmp_path, MINIMAL + "sampling: {max_new_tokens: 2024-01-01}\n")
    assert message == "'sampling.max_new_tokens' must be an integer, got '2024-01-01' (str)"
    cfg = load_job_config(write(tmp_path, MINIMAL + "prompts: [{name: day, text: 2024-01-01}]\n"))
    assert cfg.prompts[0].text == "2024-01-01"
    assert "'sampling.max_new_tokens' must be an integer" in error_of(
        tmp_path, MINIMAL, ["sampling.max_new_tokens=2024-01-01"]
    )


def test_a_dict_built_in_python_takes_paths_and_numpy_integers_and_refuses_other_objects(tmp_path):
    import numpy as np

    data = {
        "model": {"path": Path("/models/m")},
        "input": {"paths": [tmp_path / "d"]},
        "output": {"dir": "o"},
    }
    cfg = job_config_from_dict({**data, "sampling": {"max_new_tokens": np.int64(7)}}, tmp_path)
    assert cfg.model.path == "/models/m" and cfg.input.paths == [str(tmp_path / "d")]
    assert cfg.sampling.max_new_tokens == 7 and type(cfg.sampling.max_new_tokens) is int
    with pytest.raises(ConfigError, match=r"^'sampling.stop' holds a set \("):
        job_config_from_dict({**data, "sampling": {"stop": {"a"}}}, tmp_path)


def test_a_job_file_that_is_not_utf8_is_a_one_line_mistake(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_bytes(MINIMAL.encode() + b"prompts: [{name: a, text: \xff}]\n")
    with pytest.raises(ConfigError) as info:
        load_job_config(path)
    assert str(info.value) == f"{path}: line 5 is not UTF-8 text (byte 0xff); save the job file as UTF-8"


@pytest.mark.parametrize("written", ["1e3", "1.0e3", "1E+3", "1_000e0"])
def test_an_exponent_without_a_dot_or_a_sign_is_a_number_as_yaml_1_2_reads_it(tmp_path, written):
    cfg = load_job_config(write(tmp_path, MINIMAL + f"engine: {{kv_cache_mb: {written}}}\n"))
    assert cfg.engine.kv_cache_mb == 1000.0
    assert (
        load_job_config(write(tmp_path, MINIMAL), [f"engine.kv_cache_mb={written}"]).engine.kv_cache_mb
        == 1000
    )


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("sampling.temperature=.inf", "'sampling.temperature' must be a finite number, got inf"),
        ("preprocess.timeout_s=-.inf", "'preprocess.timeout_s' must be a finite number, got -inf"),
        ("engine.threads=100000", "'engine.threads' must be in [0, 1024], got 100000"),
        ("preprocess.workers=5000", "'preprocess.workers' must be in [0, 1024], got 5000"),
        (
            "preprocess.video_min_frames=100",
            "'preprocess.video_min_frames' (100) must not exceed 'preprocess.video_max_frames' (64)",
        ),
        ('output.dir=" "', "'output.dir' is empty; name the folder the results go to"),
        (
            "preprocess.min_pixels=1000000000000",
            "'preprocess.min_pixels' (1000000000000) must not exceed 'preprocess.max_image_pixels' "
            "(50000000)",
        ),
        ('input.paths=["a/*.parquet", ""]', "'input.paths' holds an empty path: "),
        ('sampling.stop=["END", ""]', "'sampling.stop' holds an empty string, which stops at no text"),
        (
            'prompts=[{name: a, text: t, sampling: {stop: [""]}}]',
            "'prompts[0].sampling.stop' holds an empty string, which stops at no text; remove it",
        ),
    ],
)
def test_values_no_run_can_use_are_refused(tmp_path, override, message):
    assert error_of(tmp_path, MINIMAL, [override]).startswith(message)
