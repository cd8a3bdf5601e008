"""Planning refuses what would lose or overwrite data, before any work: shard names that move or collide,
an output folder over the input or not writable, a shard without the job's columns, a prompt field no
shard has. Folder shards stay put when files are added. `validate` and `run` refuse the same things."""

import io
import os
import shutil
import subprocess
import sys
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from batchvl.commands.status import format_status, job_status
from batchvl.config import job_config_from_dict
from batchvl.engine.encoder_cache.disk import EncoderDiskCache
from batchvl.engine.encoder_cache.disk_layout import MARKER
from batchvl.errors import UserError
from batchvl.inputs.folder import missing_members
from batchvl.pipeline import runner
from batchvl.pipeline.plan import plan_job
from batchvl.pipeline.runner import run_job
from batchvl.pipeline.tasks import TaskSlice
from tests.conftest import cli as in_process
from tests.conftest import png_bytes, random_image


def config(tmp_path, model_dir, paths, out="out", **sections):
    fmt = sections.pop("format", "parquet")
    data = {
        "model": {"path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "input": {"paths": paths, "format": fmt, **sections.pop("input", {})},
        "output": {"dir": out},
        "sampling": {"max_new_tokens": 3},
        "preprocess": {"workers": 0},
        **sections,
    }
    return job_config_from_dict(data, tmp_path)


def table(path, **columns):
    path.parent.mkdir(parents=True, exist_ok=True)
    columns.setdefault("image", [png_bytes(random_image(20, 24, seed=1))])
    pq.write_table(pa.table(columns), path)
    return path


def refusal(cfg) -> str:
    with pytest.raises(UserError) as info:
        plan_job(cfg)
    assert "\n" not in str(info.value)
    return str(info.value)


def write_images(folder, names):
    folder.mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(names):
        (folder / name).write_bytes(png_bytes(random_image(24, 28 + i, seed=i)))


def members(plan) -> dict[str, tuple[str, ...]]:
    return {shard.shard: shard.members for shard in plan.listing}


def test_folder_shards_stay_put_when_files_are_added_removed_or_renamed(tmp_path, tiny_model_dir):
    photos = tmp_path / "photos"
    write_images(photos, [f"{c}.png" for c in "bcdefg"])
    cfg = config(tmp_path, tiny_model_dir, ["photos"], format="folder", input={"files_per_shard": 4})
    first = members(plan_job(cfg, record=True))
    assert first == {
        "photos/part-00000": ("b.png", "c.png", "d.png", "e.png"),
        "photos/part-00001": ("f.png", "g.png"),
    }
    write_images(photos, ["a.png", "h.png"])
    os.rename(photos / "c.png", photos / "c2.png")
    # A look (validate, status) proposes the new shard without recording it; a run records it.
    assert members(plan_job(cfg)) == {**first, "photos/part-00002": ("a.png", "c2.png", "h.png")}
    assert not (tmp_path / "out" / "_batchvl" / "folder_shards" / "photos" / "part-00002.json").exists()
    plan = plan_job(cfg, record=True)
    assert members(plan) == {**first, "photos/part-00002": ("a.png", "c2.png", "h.png")}
    assert [missing_members(shard) for shard in plan.listing] == [1, 0, 0]  # c.png is gone
    write_images(photos, ["0.png"])
    assert members(plan_job(cfg, record=True))["photos/part-00003"] == ("0.png",)


def test_adding_files_to_a_folder_job_captions_each_new_file_once(tmp_path, tiny_model_dir, loaded_fp32):
    photos = tmp_path / "photos"
    write_images(photos, [f"{c}.png" for c in "bcdefg"])
    cfg = config(tmp_path, tiny_model_dir, ["photos"], format="folder", input={"files_per_shard": 2})
    run_job(cfg, loaded=loaded_fp32, show_progress=False, task=TaskSlice(0, 2))  # some shards stay open
    write_images(photos, ["a.png", "h.png"])
    summary = run_job(cfg, loaded=loaded_fp32, show_progress=False)
    assert summary.stats["shards_skipped"] > 0
    keys = [
        key
        for path in sorted((tmp_path / "out" / "photos").glob("*.parquet"))
        for key in pq.read_table(path)["key"].to_pylist()
    ]
    assert sorted(keys) == [f"{c}.png" for c in "abcdefgh"]  # each file once: none skipped, none twice

    os.remove(photos / "b.png")  # a file of a committed shard: its rows stay, and status says so
    text = format_status(job_status(cfg), "job.yaml")
    assert "1 input file(s) of recorded shards are gone" in text and "shards: 4 of 4 done" in text


def test_an_image_replaced_under_its_name_in_a_folder_job_reruns_its_shard_whole(
    tmp_path, tiny_model_dir, loaded_fp32
):
    photos = tmp_path / "photos"
    write_images(photos, [f"{c}.png" for c in "bcde"])
    cfg = config(tmp_path, tiny_model_dir, ["photos"], format="folder", input={"files_per_shard": 2})
    run_job(cfg, loaded=loaded_fp32, show_progress=False)
    (photos / "d.png").write_bytes(png_bytes(random_image(30, 40, seed=99)))  # another image, same name
    os.utime(photos / "d.png", ns=(10**18, 10**18))  # a time of its own, whatever the clock's resolution
    os.remove(photos / "b.png")  # a file gone from a committed shard: its rows stay, its shard is done

    summary = run_job(cfg, loaded=loaded_fp32, show_progress=False)
    assert (summary.stats["shards_skipped"], summary.stats["shards_committed"]) == (1, 1)
    # the shard run again equals a fresh run over its files as they are now
    fresh_photos = tmp_path / "fresh" / "photos"
    fresh_photos.mkdir(parents=True)
    for name in ("d.png", "e.png"):
        shutil.copy(photos / name, fresh_photos / name)
    fresh = config(
        tmp_path / "fresh", tiny_model_dir, ["photos"], format="folder", input={"files_per_shard": 2}
    )
    run_job(fresh, loaded=loaded_fp32, show_progress=False)
    rows = pq.read_table(tmp_path / "out" / "photos" / "part-00001.parquet").drop_columns(["latency_s"])
    expected = pq.read_table(fresh_photos.parent / "out" / "photos" / "part-00000.parquet")
    assert rows.to_pylist() == expected.drop_columns(["latency_s"]).to_pylist()
    assert run_job(cfg, loaded=loaded_fp32, show_progress=False).stats["shards_skipped"] == 2


def test_output_dir_over_among_or_inside_the_input_is_refused(tmp_path, tiny_model_dir):
    data = tmp_path / "d"
    table(data / "x.parquet")
    message = refusal(config(tmp_path, tiny_model_dir, [str(data / "*.parquet")], out=str(data)))
    assert f"output.dir {data} overlaps the input {data / 'x.parquet'}" in message
    # A recursive glob would read the results back as input on the next run.
    message = refusal(config(tmp_path, tiny_model_dir, [str(data / "**" / "*.parquet")], out=str(data / "o")))
    assert "would read the results" in message and str(data / "o") in message
    # Symlinks are resolved: a link to the input folder is the input folder.
    os.symlink(data, tmp_path / "link")
    assert "overlaps the input" in refusal(
        config(tmp_path, tiny_model_dir, [str(data / "*.parquet")], out=str(tmp_path / "link"))
    )
    (tmp_path / "media" / "img").mkdir(parents=True)
    for out, root in (("media", "media"), ("media", "media/img")):  # the media would lie among the results
        message = refusal(
            config(tmp_path, tiny_model_dir, [str(data / "*.parquet")], out=out, input={"root": root})
        )
        assert f"output.dir {tmp_path / 'media'} holds input.root {tmp_path / root}: the media" in message
    message = refusal(config(tmp_path, tiny_model_dir, [str(data / "*.parquet")], input={"root": "nowhere"}))
    assert message == f"input.root: {tmp_path / 'nowhere'} is not a folder; point it at the media's folder"
    # results in a folder of their own under the root read nothing back: a project's captions/ beside images/
    plan_job(
        config(tmp_path, tiny_model_dir, [str(data / "*.parquet")], out="media/out", input={"root": "media"})
    )
    write_images(tmp_path / "photos", ["a.png"])
    message = refusal(config(tmp_path, tiny_model_dir, ["photos"], out="photos/captions", format="folder"))
    assert "overlaps the input" in message
    assert not (tmp_path / "photos" / "captions").exists()  # refused before anything is written
    # A sibling folder is fine.
    plan_job(config(tmp_path, tiny_model_dir, [str(data / "*.parquet")], out="results"), record=True)


def test_two_inputs_with_one_output_name_are_refused(tmp_path, tiny_model_dir):
    (tmp_path / "tars").mkdir()
    for name in ("s.tar", "s.tar.gz"):
        (tmp_path / "tars" / name).write_bytes(b"")
    message = refusal(config(tmp_path, tiny_model_dir, ["tars/*"], format="webdataset"))
    assert "tars/s.tar and" in message and "tars/s.tar.gz would both write s.parquet" in message
    table(tmp_path / "a" / "x.parquet")
    table(tmp_path / "b" / "x.parquet")
    message = refusal(config(tmp_path, tiny_model_dir, ["a/*.parquet", "b/*.parquet"]))
    assert "would both write x.parquet" in message


def test_adding_an_input_glob_does_not_rename_existing_shards(tmp_path, tiny_model_dir):
    table(tmp_path / "a" / "x.parquet")
    table(tmp_path / "b" / "y.parquet")
    one = plan_job(config(tmp_path, tiny_model_dir, ["a/*.parquet"]))
    two = plan_job(config(tmp_path, tiny_model_dir, ["a/*.parquet", "b/*.parquet"]))
    assert [s.shard for s in one.listing] == ["x.parquet"]
    assert [s.shard for s in two.listing] == ["x.parquet", "y.parquet"]


def test_every_shard_schema_and_prompt_field_is_checked_up_front(tmp_path, tiny_model_dir):
    table(tmp_path / "data" / "p0.parquet", question=["q"])
    pq.write_table(pa.table({"picture": [b"x"], "question": ["q"]}), tmp_path / "data" / "p1.parquet")
    table(tmp_path / "data" / "p2.parquet", question=["q"])
    cfg = config(tmp_path, tiny_model_dir, ["data/*.parquet"])
    message = refusal(cfg)
    assert "input.image_column: column 'image' is not in" in message and "p1.parquet" in message
    os.remove(tmp_path / "data" / "p1.parquet")
    typo = [{"name": "ask", "text": "{questoin} and {key}"}]
    message = refusal(config(tmp_path, tiny_model_dir, ["data/*.parquet"], prompts=typo))
    assert "prompt 'ask' uses {questoin}" in message and "did you mean 'question'?" in message
    budget = {"max_new_tokens_field": "budget"}
    message = refusal(config(tmp_path, tiny_model_dir, ["data/*.parquet"], sampling=budget))
    assert "sampling.max_new_tokens_field: column 'budget' is not in" in message
    table(tmp_path / "data" / "p0.parquet", question=["q"], budget=[64])
    table(tmp_path / "data" / "p2.parquet", question=["q"], budget=["64"])  # text, not a number
    message = refusal(config(tmp_path, tiny_model_dir, ["data/*.parquet"], sampling=budget))
    assert message == (
        f"sampling.max_new_tokens_field: column 'budget' of {tmp_path / 'data' / 'p2.parquet'} holds string, "
        "not numbers; name a column of per-sample token limits"
    )
    write_images(tmp_path / "photos", ["a.png"])
    message = refusal(config(tmp_path, tiny_model_dir, ["photos"], format="folder", prompts=typo))
    assert "folder input has no fields" in message
    os.remove(tmp_path / "data" / "p2.parquet")
    for key in ("image", "budget"):  # bytes made megabyte keys of each image; numbers are ids
        cfg = config(tmp_path, tiny_model_dir, ["data/*.parquet"], input={"key_column": key})
        if key == "budget":
            plan_job(cfg)
            continue
        assert refusal(cfg) == (
            f"input.key_column: column 'image' of {tmp_path / 'data' / 'p0.parquet'} holds binary, "
            "not single values such as text or numbers; name a column of sample ids, or leave key_column "
            "out (each row's index is its key)"
        )


def cli(*args, cwd):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "batchvl", *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env
    )


def test_validate_and_run_refuse_the_same_mistakes_before_any_work(
    tmp_path, tiny_model_dir, monkeypatch, capsys
):
    table(tmp_path / "data" / "p0.parquet", key=["a"])
    pq.write_table(pa.table({"key": ["b"], "picture": [b"x"]}), tmp_path / "data" / "p1.parquet")
    (tmp_path / "a-file").write_text("")
    (tmp_path / "job.yaml").write_text(
        f"model: {{path: {tiny_model_dir}, dtype: float32}}\n"
        "input: {paths: [data/*.parquet], key_column: key}\n"
        "output: {dir: out}\n"
    )
    shutil.copytree(
        tiny_model_dir, tmp_path / "no-tokenizer", ignore=shutil.ignore_patterns("tokenizer.json")
    )
    mistakes = [
        (["--set", "model.path=no-tokenizer"], "has no usable tokenizer"),
        (["--set", "engine.kv_cache_mb=1e12"], "is more than this machine's memory"),
        (["--set", "sampling.stop_token_ids=[2, 99999]"], "stop_token_ids holds 99999, outside the model's"),
        ([], "column 'image' is not in"),
        (["--set", "output.dir=a-file/out"], "a-file is not a folder"),
        (["--set", "output.dir=/proc/batchvl-out"], "cannot be written"),
        (["--set", "output.dir=data"], "overlaps the input"),
        (["--set", "engine.encoder_cache_dir=a-file/cache"], "engine.encoder_cache_dir: "),
        (["--set", "engine.encoder_cache_dir=/proc/batchvl-cache"], "/proc cannot be written"),
    ]
    monkeypatch.chdir(tmp_path)
    for args, fragment in mistakes:
        for command in ("validate", "run"):
            code, _, err = in_process(monkeypatch, capsys, command, "job.yaml", *args)
            assert code == 2, (command, args, err)
            (line,) = err.strip().splitlines()
            assert fragment in line, (command, line)
    assert not (tmp_path / "out").exists()
    assert sorted(os.listdir(tmp_path / "data")) == ["p0.parquet", "p1.parquet"]

    os.remove(tmp_path / "data" / "p1.parquet")
    assert cli("run", "job.yaml", "--no-progress", cwd=tmp_path).returncode == 0
    done = cli("validate", "job.yaml", cwd=tmp_path)
    assert (
        done.returncode == 0
        and "(1 shard(s) committed as the job defines them, 0 committed with other prompts, 0 to run whole)"
        in done.stdout
    )
    done = cli("validate", "job.yaml", "--set", "preprocess.max_pixels=40000", cwd=tmp_path)
    assert (
        done.returncode == 2
        and "written with a different config (changed: preprocess.max_pixels)" in done.stderr
    )


def test_a_download_cache_that_is_a_file_is_refused(tmp_path, tiny_model_dir):
    table(tmp_path / "data" / "a.parquet")
    (tmp_path / "cache").write_text("not a folder")
    for cache_dir in ("cache", "cache/below"):
        cfg = config(
            tmp_path, tiny_model_dir, ["data/*.parquet"], input={"download": {"cache_dir": cache_dir}}
        )
        assert refusal(cfg) == (
            f"input.download.cache_dir: {tmp_path / 'cache'} is a file, not a folder; point it at a folder"
        )
    cfg = config(tmp_path, tiny_model_dir, ["data/*.parquet"], input={"download": {"cache_dir": "new/cache"}})
    plan_job(cfg)  # made on first use


def test_an_encoder_cache_dir_that_cannot_be_made_is_refused_before_the_model_loads(
    tmp_path, tiny_model_dir, loaded_fp32, monkeypatch
):
    """A path under a file, and a folder nothing can be made in (/proc: root too is refused there, where
    permission bits would let it write), are found by the plan; the model is never loaded."""
    table(tmp_path / "data" / "a.parquet")
    (tmp_path / "a-file").write_text("")
    loads = []
    monkeypatch.setattr(runner, "load_job_model", lambda cfg, *_: (loads.append(cfg), (loaded_fp32, 0.0))[1])
    refused = {
        "a-file/cache": f"{tmp_path / 'a-file'} is a file, not a folder; point it at a folder",
        "/proc/batchvl-cache": "/proc cannot be written; point it at a folder you own",
    }
    for folder, message in refused.items():
        cfg = config(tmp_path, tiny_model_dir, ["data/*.parquet"], engine={"encoder_cache_dir": folder})
        with pytest.raises(UserError) as info:
            run_job(cfg, show_progress=False)
        assert str(info.value) == f"engine.encoder_cache_dir: {message}"
    assert loads == [] and not (tmp_path / "out").exists()
    cfg = config(tmp_path, tiny_model_dir, ["data/*.parquet"], engine={"encoder_cache_dir": "new/cache"})
    plan_job(cfg)  # made on first use; the plan's check leaves nothing behind
    assert sorted(os.listdir(tmp_path)) == ["a-file", "data"]


def test_an_encoder_cache_dir_of_other_files_or_in_output_dir_is_refused_in_one_line(
    tmp_path, tiny_model_dir
):
    """The cache deletes files in its folder: a folder holding files it did not write is refused (and left
    as it was), and so is a folder inside output.dir or around it; a new, empty or marked one is not."""
    table(tmp_path / "data" / "a.parquet")

    def cache_at(folder, out="out"):
        return config(
            tmp_path, tiny_model_dir, ["data/*.parquet"], out=out, engine={"encoder_cache_dir": folder}
        )

    (tmp_path / "photos").mkdir()
    (tmp_path / "photos" / "draft.tmp").write_text("mine")
    assert refusal(cache_at("photos")) == (
        f"engine.encoder_cache_dir: {tmp_path / 'photos'} holds files the encoder cache did not write "
        f"(draft.tmp) and no {MARKER} marker; point it at an empty or new folder, or at the folder of an "
        "earlier encoder cache"
    )
    assert os.listdir(tmp_path / "photos") == ["draft.tmp"]
    for folder, out in (("out/cache", "out"), ("cache", "cache/out"), ("same", "same")):
        assert refusal(cache_at(folder, out)) == (
            f"engine.encoder_cache_dir: {tmp_path / folder} overlaps output.dir {tmp_path / out}: the "
            "cache's files would be among the results; put the cache in a folder outside output.dir"
        )
    (tmp_path / "empty").mkdir()
    EncoderDiskCache(str(tmp_path / "marked"), 1 << 30, "digest").store("image", torch.ones(2, 3))
    for folder in ("new", "empty", "marked"):
        plan_job(cache_at(folder))
    assert not os.path.exists(tmp_path / "empty" / MARKER)  # planning writes nothing


def test_a_gpu_the_machine_does_not_have_is_refused_before_the_model_loads(
    tmp_path, tiny_model_dir, monkeypatch
):
    data = tmp_path / "d"
    table(data / "x.parquet")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    cfg = config(
        tmp_path,
        tiny_model_dir,
        [str(data / "*.parquet")],
        model={"path": str(tiny_model_dir), "device": "cuda"},
    )
    assert refusal(cfg) == "model.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'"
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    cfg = config(
        tmp_path,
        tiny_model_dir,
        [str(data / "*.parquet")],
        model={"path": str(tiny_model_dir), "device": "cuda:1"},
    )
    assert "this machine has 1 CUDA device(s), cuda:0 to cuda:0" in refusal(cfg)


def test_engine_replicas_on_a_gpu_or_with_vit_data_parallelism_are_refused(
    tmp_path, tiny_model_dir, monkeypatch
):
    data = tmp_path / "d"
    table(data / "x.parquet")
    paths = [str(data / "*.parquet")]
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    on_gpu = {"path": str(tiny_model_dir), "device": "cuda"}
    cfg = config(tmp_path, tiny_model_dir, paths, model=on_gpu, engine={"replicas": 2})
    assert refusal(cfg) == (
        "engine.replicas=2 runs engines side by side on the CPU, but model.device is cuda; leave "
        "engine.replicas at auto (one engine on a GPU)"
    )
    cfg = config(tmp_path, tiny_model_dir, paths, engine={"replicas": 2, "vit_parallel": "data"})
    assert refusal(cfg) == (
        "engine.replicas=2 cannot be combined with engine.vit_parallel: data; set one of them"
    )
    plan_job(config(tmp_path, tiny_model_dir, paths, model=on_gpu, engine={"replicas": "auto"}))
    plan_job(config(tmp_path, tiny_model_dir, paths, engine={"replicas": 2}))


def test_inputs_that_hold_no_sample_are_refused_naming_what_they_hold(tmp_path, tiny_model_dir):
    for name in ("p0.parquet", "p1.parquet", "p2.parquet"):
        table(tmp_path / "tables" / name, key=["a"])
    message = refusal(config(tmp_path, tiny_model_dir, ["tables"], format="folder"))
    assert message == (
        f"input.paths: the folder reader found no image or video under {tmp_path / 'tables'} (it holds 3 "
        ".parquet files); set input.format: parquet"
    )
    (tmp_path / "empty").mkdir()
    message = refusal(config(tmp_path, tiny_model_dir, ["empty"], format="folder"))
    assert "(it holds no file); point input.paths at folders of images or videos" in message
    pq.write_table(pa.table({"image": pa.array([], pa.binary())}), tmp_path / "none.parquet")
    message = refusal(config(tmp_path, tiny_model_dir, ["none.parquet"]))
    assert message.startswith("input.paths: the 1 input shard(s) hold no rows (")


def test_a_run_over_a_folder_without_media_is_one_line_exit_2_before_any_work(tmp_path, tiny_model_dir):
    table(tmp_path / "data" / "p0.parquet", key=["a"])
    (tmp_path / "job.yaml").write_text(
        f"model: {{path: {tiny_model_dir}, dtype: float32}}\n"
        "input: {paths: [data], format: folder}\n"
        "output: {dir: out}\n"
    )
    done = cli("run", "job.yaml", "--no-progress", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("error: input.paths: the folder reader found no image or video under")
    assert line.endswith("(it holds 1 .parquet file); set input.format: parquet")
    assert not (tmp_path / "out").exists()


def test_a_job_of_a_few_requests_runs_one_engine_and_a_larger_one_replicas(tmp_path, tiny_model_dir):
    """`engine.replicas: auto` counts the run's requests first: split over replicas, a few requests run
    slower than on one engine of every thread (docs/benchmarks.md)."""
    from batchvl.config import EngineConfig
    from batchvl.engine.parallel.replicas import FEWEST_REQUESTS_FOR_REPLICAS, replica_count

    image = png_bytes(random_image(20, 24, seed=1))
    prompts = [{"name": "a", "text": "Describe."}, {"name": "b", "text": "Name it."}]
    per_core = replica_count(EngineConfig(threads=2), torch.device("cpu"), under_torchrun=False)
    for samples, engines in (
        (FEWEST_REQUESTS_FOR_REPLICAS // 2 - 1, 1),
        (FEWEST_REQUESTS_FOR_REPLICAS // 2, per_core),
    ):
        keys = [f"k{i}" for i in range(samples)]
        table(tmp_path / f"in{samples}" / "part-0.parquet", key=keys, image=[image] * samples)
        cfg = config(
            tmp_path,
            tiny_model_dir,
            [str(tmp_path / f"in{samples}" / "*.parquet")],
            out=str(tmp_path / f"out{samples}"),
            input={"key_column": "key"},
            prompts=prompts,
            sampling={"max_new_tokens": 2},
            engine={"threads": 2},
        )
        stats = run_job(cfg, show_progress=False).stats
        assert (stats["ok"], stats["engine_replicas"]) == (2 * samples, engines), samples


def test_a_runs_requests_are_bounded_by_its_samples_and_prompts(tmp_path, tiny_model_dir):
    from batchvl.pipeline.plan import job_work

    image = png_bytes(random_image(20, 24, seed=1))
    table(tmp_path / "in" / "part-0.parquet", image=[image] * 3)
    table(tmp_path / "in" / "part-1.parquet", image=[image] * 4)
    prompts = [{"name": "a", "text": "Describe."}, {"name": "b", "text": "Name it."}]
    cfg = config(tmp_path, tiny_model_dir, [str(tmp_path / "in" / "*.parquet")], prompts=prompts)
    assert job_work(cfg, None).most_requests(2) == 14
    (tmp_path / "shards").mkdir()
    with tarfile.open(tmp_path / "shards" / "a.tar", "w") as tar_file:
        member = tarfile.TarInfo("x.png")
        member.size = len(image)
        tar_file.addfile(member, io.BytesIO(image))
    tar = config(tmp_path, tiny_model_dir, [str(tmp_path / "shards" / "*.tar")], format="webdataset")
    assert job_work(tar, None).most_requests(1) is None  # a tar's samples are known only by reading it
