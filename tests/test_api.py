"""The Python API: the CLI's rows from an in-memory dataset or a config dict, resume, and its mistakes."""

import io
import os
import subprocess
import sys
from pathlib import Path

import datasets
import PIL.Image
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import batchvl
from batchvl.api import _job_config, holds_paths
from batchvl.errors import UserError
from tests.conftest import png_bytes, random_image

COMPARED = [
    "key",
    "prompt",
    "text",
    "status",
    "error_type",
    "error_message",
    "num_prompt_tokens",
    "num_output_tokens",
    "finish_reason",
    "num_images",
    "question",
]
PROMPTS = {"caption": "Describe this image.", "vqa": "{question}"}


def jpeg_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def images():
    """Image bytes: varied sizes, a repeat, a JPEG and one that is not an image."""
    made = [png_bytes(random_image(40 + 30 * i, 90 - 10 * i, seed=i)) for i in range(4)]
    return [made[0], made[1], b"not an image at all", made[2], made[0], jpeg_bytes(random_image(70, 50, 9))]


@pytest.fixture(scope="module")
def questions(images):
    return [f"What is in picture {i}?" for i in range(len(images))]


@pytest.fixture(scope="module")
def in_memory(images, questions):
    return datasets.Dataset.from_dict(
        {"image": [{"bytes": b, "path": None} for b in images], "question": questions},
        features=datasets.Features({"image": datasets.Image(), "question": datasets.Value("string")}),
    )


def cli_rows(tmp_path, model_dir, images, questions) -> list[dict]:
    """The same samples as a Parquet shard through `python -m batchvl run` (keys = row indices)."""
    (tmp_path / "data").mkdir(parents=True)
    pq.write_table(
        pa.table({"key": [str(i) for i in range(len(images))], "image": images, "question": questions}),
        tmp_path / "data" / "part-0.parquet",
    )
    (tmp_path / "job.yaml").write_text(
        f"model: {{path: {model_dir}, dtype: float32, device: cpu}}\n"
        'input: {paths: ["data/*.parquet"], key_column: key}\n'
        "prompts: [{name: caption, text: Describe this image.}, {name: vqa, text: '{question}'}]\n"
        "sampling: {max_new_tokens: 7}\n"
        "engine: {max_num_batched_tokens: 64}\n"
        "output: {dir: out}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "batchvl", "run", "job.yaml", "--no-progress"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    return pq.read_table(tmp_path / "out" / "part-0.parquet").select(COMPARED).to_pylist()


def test_caption_gives_the_cli_rows(tmp_path, tiny_model_dir, loaded_fp32, in_memory, images, questions):
    results = batchvl.caption(
        in_memory,
        model=loaded_fp32,
        prompts=PROMPTS,
        output_dir=tmp_path / "captions",
        sampling={"max_new_tokens": 7},
        engine={"max_num_batched_tokens": 64},
        rows_per_shard=4,  # two shards: keys are still the rows of the caller's dataset
        progress=False,
    )
    assert isinstance(results.dataset, datasets.Dataset)
    assert results.dataset.num_rows == 2 * len(images)
    assert results.dataset.select_columns(COMPARED).to_list() == cli_rows(
        tmp_path / "cli", tiny_model_dir, images, questions
    )
    errors = results.errors
    assert errors["key"] == ["2", "2"] and set(errors["error_type"]) == {"image_decode_error"}
    assert results.ok.num_rows == 2 * len(images) - 2
    frame = results.to_pandas()
    assert list(frame["key"]) == [str(i) for i in range(len(images)) for _ in PROMPTS]
    assert sorted(set(frame["shard"])) == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert results.stats["images_encoded"] == 4  # the repeated image is encoded once

    # The README's join-back: one row per image that got a caption (not one per prompt).
    captions = results.ok.filter(lambda row: row["prompt"] == "caption")
    labeled = in_memory.select([int(k) for k in captions["key"]]).add_column("caption", captions["text"])
    assert labeled.num_rows == len(images) - 1  # every image but the broken one
    assert labeled["question"] == [q for i, q in enumerate(questions) if i != 2]


def test_a_list_of_images_or_a_frame_gives_the_datasets_rows(tmp_path, loaded_fp32, in_memory, images):
    """A notebook's list of images (PIL images, bytes, a path, an empty cell) and a pandas frame are
    captioned as the same images in a Dataset are: each row's key is the image's position."""
    options = dict(model=loaded_fp32, prompts="Describe this image.", sampling={"max_new_tokens": 5})
    expected = batchvl.caption(in_memory, output_dir=tmp_path / "dataset", progress=False, **options)
    texts = {row["key"]: (row["status"], row["text"]) for row in expected.dataset.to_list()}

    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "three.png").write_bytes(images[3])
    listed = [PIL.Image.open(io.BytesIO(images[0])), images[1], images[2], None]
    results = batchvl.caption(listed, output_dir=tmp_path / "list", progress=False, **options)
    rows = {row["key"]: row for row in results.dataset.to_list()}
    assert sorted(rows) == ["0", "1", "2", "3"]
    for key in ("0", "1", "2"):
        assert (rows[key]["status"], rows[key]["text"]) == texts[key], key
    assert (rows["2"]["error_type"], rows["3"]["error_type"]) == ("image_decode_error", "missing_image")

    paths = [None, "pictures/three.png", Path("pictures/three.png")]
    from_paths = batchvl.caption(
        paths, output_dir=tmp_path / "paths", root=tmp_path, progress=False, **options
    )
    rows = {row["key"]: row for row in from_paths.dataset.to_list()}
    assert rows["0"]["error_type"] == "missing_image"
    assert (rows["1"]["status"], rows["1"]["text"]) == (rows["2"]["status"], rows["2"]["text"]) == texts["3"]
    with pytest.raises(UserError, match=r"^caption\(\) takes a list of images or a list of paths and URLs"):
        batchvl.caption([images[0], "pictures/three.png"], output_dir=tmp_path / "mixed", **options)

    frame = in_memory.to_pandas()
    from_frame = batchvl.caption(frame, output_dir=tmp_path / "frame", progress=False, **options)
    assert {row["key"]: (row["status"], row["text"]) for row in from_frame.dataset.to_list()} == texts


def test_caption_resumes_and_refuses_another_dataset(tmp_path, loaded_fp32, in_memory):
    options = dict(model=loaded_fp32, prompts="Describe this image.", sampling={"max_new_tokens": 4})
    out = tmp_path / "captions"
    first = batchvl.caption(in_memory, output_dir=out, progress=False, **options)
    again = batchvl.caption(in_memory, output_dir=out, progress=False, **options)
    assert again.stats["shards_skipped"] == 1 and again.stats["samples"] == 0
    assert again.dataset.to_list() == first.dataset.to_list()

    subset = in_memory.select([0, 1, 3])
    with pytest.raises(UserError, match="another dataset"):
        batchvl.caption(subset, output_dir=out, progress=False, **options)
    replaced = batchvl.caption(subset, output_dir=out, overwrite=True, progress=False, **options)
    assert replaced.dataset["key"] == ["0", "1", "2"]
    assert replaced.dataset["text"] == [first.dataset["text"][i] for i in (0, 1, 3)]
    assert len(os.listdir(out / "_batchvl" / "input")) == 2  # dataset.json and the one staged dataset


def test_caption_reads_paths_against_the_current_folder_or_root(tmp_path, loaded_fp32, images, monkeypatch):
    (tmp_path / "nb" / "imgs").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "nb" / "imgs" / "a.png").write_bytes(images[0])
    (tmp_path / "elsewhere" / "b.png").write_bytes(images[1])
    monkeypatch.chdir(tmp_path / "nb")  # a notebook's folder
    outside = str(tmp_path / "elsewhere" / "b.png")
    paths = datasets.Dataset.from_dict(
        {"image": ["imgs/a.png", str(tmp_path / "nb" / "imgs" / "a.png"), outside]}
    )
    options = dict(model=loaded_fp32, sampling={"max_new_tokens": 3}, progress=False)
    results = batchvl.caption(paths, output_dir="out", **options)
    assert results.dataset["status"] == ["ok", "ok", "error"]
    assert results.dataset["text"][0] == results.dataset["text"][1]  # the same file, named two ways
    assert results.dataset["error_type"][2] == "path_outside_root"
    assert f"not under input.root '{tmp_path / 'nb'}'" in results.dataset["error_message"][2]
    anywhere = batchvl.caption(paths.select([2]), output_dir=tmp_path / "anywhere", root="/", **options)
    assert anywhere.dataset["status"] == ["ok"]
    # datasets' Image feature over paths (no bytes kept) reads them the same way
    as_images = datasets.Dataset.from_dict({"image": ["imgs/a.png"]}).cast_column("image", datasets.Image())
    assert (
        batchvl.caption(as_images, output_dir="images", **options).dataset["text"]
        == results.dataset["text"][:1]
    )
    with pytest.raises(
        UserError, match="^root= is the folder the image paths resolve against; 'nope' is not"
    ):
        batchvl.caption(paths, output_dir="x", root="nope", **options)


def test_only_a_column_that_reads_paths_sets_a_root(in_memory):
    assert not holds_paths(in_memory.data.column("image"))  # Image feature with bytes: the job's default
    assert holds_paths(pa.chunked_array([pa.array([["a.png"], ["b.png"]])]))
    assert not holds_paths(pa.chunked_array([pa.array([None, None], type=pa.string())]))


def test_run_from_a_dict_and_read_results(
    tmp_path, tiny_model_dir, loaded_fp32, images, questions, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for number, part in enumerate((slice(0, 4), slice(4, 6))):
        shard_column = ["ab"[number]] * len(images[part])  # an input column that clashes with `shard`
        pq.write_table(
            pa.table(
                {
                    "image": images[part],
                    "question": questions[part],
                    "shard": shard_column,
                    "input_shard": ["own"] * len(shard_column),  # and with the name it would get
                }
            ),
            tmp_path / "data" / f"part-{number}.parquet",
        )
    job = {
        "model": {"path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
        "input": {"paths": ["data/*.parquet"]},
        "prompts": [{"name": "vqa", "text": "{question}"}],
        "sampling": {"max_new_tokens": 5},
        "output": {"dir": "out"},
    }
    results = batchvl.run(job, model=loaded_fp32, progress=False)
    rows = results.dataset.to_list()
    assert [(r["shard"], r["sample_index"]) for r in rows] == [("part-0.parquet", i) for i in range(4)] + [
        ("part-1.parquet", i) for i in range(2)
    ]
    assert [r["input_input_shard"] for r in rows] == ["a"] * 4 + ["b"] * 2  # an input column named shard
    assert [r["input_shard"] for r in rows] == ["own"] * 6
    assert results.output_dir == str(tmp_path / "out")
    assert batchvl.read_results(job).to_list() == rows
    files = [pq.read_table(tmp_path / "out" / f"part-{n}.parquet") for n in range(2)]
    assert [r["text"] for r in rows] == [t for table in files for t in table["text"].to_pylist()]


def test_caption_takes_a_prompts_keys_in_the_name_mapping(tmp_path, loaded_fp32, in_memory):
    prompts = {
        "kind": {"text": "Photo or drawing?", "choices": ["photo", "drawing"]},
        "year": {"text": "Which year?", "regex": "(19|20)[0-9]{2}"},
        "caption": "Describe this image.",
    }
    results = batchvl.caption(
        in_memory.select([0, 1]), model=loaded_fp32, prompts=prompts, output_dir=tmp_path, progress=False
    )
    rows = {(row["key"], row["prompt"]): row for row in results.dataset.to_list()}
    assert sorted(rows) == [(k, p) for k in ("0", "1") for p in ("caption", "kind", "year")]
    for key in ("0", "1"):
        kind, year = rows[(key, "kind")], rows[(key, "year")]
        assert kind["status"] == "ok" and kind["text"] in ("photo", "drawing")
        assert {entry["key"] for entry in kind["choice_probs"]} == {"photo", "drawing"}  # scored
        assert year["status"] == "ok" and len(year["text"]) == 4 and year["text"][:2] in ("19", "20")
    with pytest.raises(UserError, match=r"prompts\['kind'\] must be the prompt's text or a mapping"):
        batchvl.caption(in_memory, model=loaded_fp32, prompts={"kind": ["photo"]}, output_dir=tmp_path / "x")
    with pytest.raises(UserError, match="unknown key 'prompts\\[0\\].choice'"):
        batchvl.caption(
            in_memory,
            model=loaded_fp32,
            prompts={"k": {"text": "t", "choice": ["a"]}},
            output_dir=tmp_path / "y",
        )


def test_api_mistakes_are_user_errors(tmp_path, loaded_fp32, in_memory):
    with pytest.raises(UserError, match="image_column 'picture' is not a column .*image, question"):
        batchvl.caption(in_memory, model=loaded_fp32, output_dir=tmp_path, image_column="picture")
    with pytest.raises(UserError, match=r"one split, e.g. dataset\['train'\]"):
        batchvl.caption(datasets.DatasetDict({"train": in_memory}), model=loaded_fp32, output_dir=tmp_path)
    other = {"model": {"path": str(tmp_path)}, "input": {"paths": ["x"]}, "output": {"dir": "o"}}
    with pytest.raises(UserError, match="model= was loaded from"):
        batchvl.run(other, model=loaded_fp32)


def test_arguments_of_the_wrong_kind_are_user_errors_naming_what_is_taken(tmp_path, loaded_fp32, in_memory):
    with pytest.raises(
        UserError, match=r"^a job is a JobConfig, a dict shaped like the job file .*; got int$"
    ):
        batchvl.run(5)
    with pytest.raises(
        UserError, match=r"^caption\(\) takes a list of images .*, but it holds a int; build one"
    ):
        batchvl.caption([1, 2], model=loaded_fp32, output_dir=tmp_path)
    with pytest.raises(
        UserError, match=r"^caption\(\) takes a datasets.Dataset, a pandas DataFrame or a list"
    ):
        batchvl.caption({"image": []}, model=loaded_fp32, output_dir=tmp_path)
    with pytest.raises(
        UserError, match=r"^caption\(\) was given an empty list: there is nothing to caption$"
    ):
        batchvl.caption([], model=loaded_fp32, output_dir=tmp_path)
    with pytest.raises(UserError, match=r"^caption\(model=\) takes a load_model\(\) result .*, got int$"):
        batchvl.caption(in_memory, model=3, output_dir=tmp_path)
    with pytest.raises(UserError, match=r"^prompts= takes a text, .*; got int$"):
        batchvl.caption(in_memory, model=loaded_fp32, output_dir=tmp_path, prompts=5)
    with pytest.raises(UserError, match="'model.dtype' must be one of float32, bfloat16, auto; got 'fp16'"):
        batchvl.load_model(tmp_path, dtype="fp16")  # refused, not loaded in float32
    with pytest.raises(UserError, match="'model.device' must be cpu, cuda, cuda:N or auto; got 'gpu'"):
        batchvl.load_model(tmp_path, device="gpu")
    for section in ("sampling", "engine", "preprocess", "download"):
        with pytest.raises(UserError, match=rf"^{section}= takes a mapping of the job file's {section} keys"):
            batchvl.caption(in_memory, model=loaded_fp32, output_dir=tmp_path, **{section: 5})
    with pytest.raises(UserError, match=r"^output_dir= takes a folder's path, got NoneType$"):
        batchvl.caption(in_memory, model=loaded_fp32, output_dir=None)
    for rows in ("3", 2.5, 0):
        with pytest.raises(UserError, match=r"^rows_per_shard must be a positive whole number, got "):
            batchvl.caption(in_memory, model=loaded_fp32, output_dir=tmp_path, rows_per_shard=rows)
    job = {"model": {"path": "m"}, "input": {"paths": ["d/*.parquet"]}, "output": {"dir": "o"}}
    with pytest.raises(UserError, match=r"^run\(model=\) takes a load_model\(\) result, got str; the job's"):
        batchvl.run(job, model="m")
    with pytest.raises(UserError, match=r"^overrides= takes 'key=value' texts, as --set does .*; got \[5\]$"):
        batchvl.run(job, overrides=[5])
    with pytest.raises(UserError, match=r"^--processes must be a whole number, 1 or more, got '2'$"):
        batchvl.run(job, processes="2")
    assert not any(tmp_path.iterdir())  # nothing was written


def test_errors_are_reachable_from_the_package_as_the_docs_catch_them():
    done = subprocess.run(
        [sys.executable, "-c", "import batchvl; print(batchvl.errors.UserError.__name__)"],
        capture_output=True,
        text=True,
    )
    assert done.stdout.strip() == "UserError", done.stderr


def test_one_override_given_as_a_string_is_one_override(tmp_path):
    job = {"model": {"path": "m"}, "input": {"paths": ["d/*.parquet"]}, "output": {"dir": "o"}}
    assert _job_config(job, "sampling.max_new_tokens=7").sampling.max_new_tokens == 7
    assert _job_config(job, None).sampling == _job_config(job, ()).sampling  # None: no overrides


def test_caption_refuses_a_mistake_of_its_job_before_it_writes_the_dataset(
    tmp_path, tiny_model_dir, in_memory
):
    with pytest.raises(UserError, match="unknown key 'sampling.max_new_token'"):
        batchvl.caption(in_memory, model=tiny_model_dir, output_dir=tmp_path, sampling={"max_new_token": 3})
    broken = tmp_path / "model"
    broken.mkdir()
    (broken / "config.json").write_text("{bad")
    with pytest.raises(UserError, match="config.json is not valid JSON"):
        batchvl.caption(in_memory, model=broken, output_dir=tmp_path / "out")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["model"]  # no copy of the dataset


def test_a_notebooks_model_is_loaded_with_a_jobs_default_engine_settings(monkeypatch, tmp_path):
    """load_model() has no engine section to read: the model gets what a job's defaults give it (on CUDA
    the fused kernels), not the loader's own plain defaults, under which a notebook's GPU would run without
    them while the same job from the command line ran with them."""
    import batchvl.api as api

    calls = []
    monkeypatch.setattr(api, "_load_model", lambda *args: calls.append(args))
    monkeypatch.setattr(api, "check_model_keys", lambda model: None)
    batchvl.load_model(tmp_path, dtype="float32", device="cpu")
    ((path, dtype, device, trust_remote_code, fused_kernels, vision_attention),) = calls
    assert (path, dtype, device, trust_remote_code) == (str(tmp_path.resolve()), "float32", "cpu", False)
    assert (fused_kernels, vision_attention) == ("auto", "auto")
