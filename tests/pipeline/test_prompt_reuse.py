"""Iterating on prompts over committed shards: the rows of unchanged prompts are kept as committed (byte for
byte, their latency too, not run again), changed and added prompts run with the follow-ups that use them,
removed prompts' rows go, and a change that defines every row is still refused. Real jobs on the tiny
model, on a local folder and on S3 (moto's server)."""

import io
import json
import uuid

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.commands.status import format_status, job_status, status_json
from batchvl.config import load_job_config, output_definition
from batchvl.engine.engine import Engine
from batchvl.errors import UserError
from batchvl.inputs.parquet import ParquetSource
from batchvl.inputs.types import ShardInfo
from batchvl.outputs.batch_output import batch_output_path
from batchvl.outputs.commit import marker_path, read_committed, read_marker
from batchvl.outputs.writers import output_path
from batchvl.pipeline import prompt_reuse as prompt_reuse_module
from batchvl.pipeline.ledger import ShardLedger
from batchvl.pipeline.prompt_graph import PromptGraph
from batchvl.pipeline.prompt_reuse import RowsToRun, prompt_reuse
from batchvl.pipeline.resume import RowCounts
from batchvl.pipeline.runner import run_job
from batchvl.pipeline.tasks import TaskSlice
from batchvl.storage.output_dir import LocalDir, open_output_dir
from tests import server_jobs
from tests.conftest import png_bytes, random_image, write_image_shards
from tests.fake_openai_server import FakeOpenAIServer
from tests.outputs.test_commit_crash_windows import Crash
from tests.test_cli import batchvl

SHARD_SIZES = [3, 2, 4]
BAD = (1, 0)  # an undecodable image: an error row per prompt, no engine request
SAMPLES = sum(SHARD_SIZES)
CAPTION = "{name: caption, text: Describe this image.}"
SHORT = "{name: short, text: One word.}"
REFINE = "{name: refine, text: 'Refine this caption: {caption}'}"  # a follow-up of caption


@pytest.fixture(scope="module")
def job_dir(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("reuse")
    write_image_shards(root / "data", SHARD_SIZES, {BAD: b"not an image"})
    (root / "job.yaml").write_text(f"""
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts: [{CAPTION}, {SHORT}, {REFINE}]
sampling: {{max_new_tokens: 5}}
preprocess: {{workers: 0}}
output: {{dir: out}}
""")
    return root


def prompts(*items: str) -> str:
    return f"prompts=[{', '.join(items)}]"


def config(job_dir, out: str, *overrides: str):
    return load_job_config(job_dir / "job.yaml", [f"output.dir={out}", *overrides])


@pytest.fixture
def engine_requests(monkeypatch):
    """The names of the prompts the engine is asked to run, one per request."""
    asked: list[int] = []
    add = Engine.add_request

    def add_and_count(self, item):
        asked.append(item.tag.prompt_index)
        add(self, item)

    monkeypatch.setattr(Engine, "add_request", add_and_count)
    return asked


def table_rows(out, shard: str) -> list[dict]:
    """A committed shard's rows, every column (latency_s too), after checking its hash."""
    return read_committed(out, shard, read_marker(out, shard)).to_pylist()


def job_rows(out) -> list[dict]:
    return [row for n in range(len(SHARD_SIZES)) for row in table_rows(out, f"part-{n}.parquet")]


def of(rows: list[dict], *names: str) -> list[dict]:
    return [row for row in rows if row["prompt"] in names]


def without_latency(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k != "latency_s"} for row in rows]


def run(cfg, loaded, task=None):
    return run_job(cfg, loaded=loaded, show_progress=False, task=task)


def fresh_rows(job_dir, loaded, name: str, *overrides: str) -> list[dict]:
    """The rows of the job with `overrides` run from scratch, into a folder of their own."""
    run(config(job_dir, f"fresh-{name}", *overrides), loaded)
    return job_rows(LocalDir(str(job_dir / f"fresh-{name}")))


def test_a_changed_prompt_runs_alone_and_the_other_prompts_keep_their_rows_byte_for_byte(
    job_dir, loaded_fp32, engine_requests
):
    out = LocalDir(str(job_dir / "changed-short"))
    run(config(job_dir, "changed-short"), loaded_fp32)
    before = job_rows(out)
    assert len(before) == 3 * SAMPLES
    engine_requests.clear()

    changed = prompts(CAPTION, "{name: short, text: Two words.}", REFINE)
    summary = run(config(job_dir, "changed-short", changed), loaded_fp32)
    assert engine_requests == [1] * (SAMPLES - 1)  # short's, of each decodable image
    assert summary.stats["shards_committed"] == len(SHARD_SIZES)
    after = job_rows(out)
    assert of(after, "caption", "refine") == of(before, "caption", "refine")  # every value, latency_s too
    assert without_latency(after) == without_latency(fresh_rows(job_dir, loaded_fp32, "short", changed))
    assert of(after, "short") != of(before, "short")

    # Committed with the new config: a rerun has nothing to do.
    engine_requests.clear()
    again = run(config(job_dir, "changed-short", changed), loaded_fp32)
    assert again.stats["shards_skipped"] == len(SHARD_SIZES) and engine_requests == []


def test_a_changed_prompt_runs_with_the_follow_ups_that_use_it(job_dir, loaded_fp32, engine_requests):
    out = LocalDir(str(job_dir / "changed-caption"))
    run(config(job_dir, "changed-caption"), loaded_fp32)
    before = job_rows(out)
    engine_requests.clear()

    changed = prompts("{name: caption, text: Describe it.}", SHORT, REFINE)
    run(config(job_dir, "changed-caption", changed), loaded_fp32)
    assert sorted(engine_requests) == [0] * (SAMPLES - 1) + [2] * (SAMPLES - 1)
    after = job_rows(out)
    assert of(after, "short") == of(before, "short")
    assert without_latency(after) == without_latency(fresh_rows(job_dir, loaded_fp32, "caption", changed))


def test_an_added_follow_up_of_an_unchanged_prompt_runs_alone_on_its_committed_output(
    job_dir, loaded_fp32, engine_requests
):
    out = LocalDir(str(job_dir / "added"))
    run(config(job_dir, "added"), loaded_fp32)
    before = job_rows(out)
    engine_requests.clear()

    added = prompts(CAPTION, "{name: shorter, continue: caption, text: Now in two words.}", SHORT, REFINE)
    run(config(job_dir, "added", added), loaded_fp32)
    assert engine_requests == [1] * (SAMPLES - 1)  # the new prompt is second: the others keep their rows
    after = job_rows(out)
    assert of(after, "caption", "short", "refine") == before  # in the job's prompt order, per sample
    assert [row["prompt"] for row in after[:4]] == ["caption", "shorter", "short", "refine"]
    assert without_latency(after) == without_latency(fresh_rows(job_dir, loaded_fp32, "added", added))


def test_a_removed_prompts_rows_are_dropped_without_reading_or_running_anything(
    job_dir, loaded_fp32, engine_requests, monkeypatch, caplog
):
    out = LocalDir(str(job_dir / "removed"))
    run(config(job_dir, "removed"), loaded_fp32)
    before = job_rows(out)
    engine_requests.clear()

    read, iter_shard = [], ParquetSource.iter_shard
    monkeypatch.setattr(ParquetSource, "iter_shard", lambda self, *a: read.append(a) or iter_shard(self, *a))
    summary = run(config(job_dir, "removed", prompts(CAPTION, REFINE)), loaded_fp32)
    assert engine_requests == [] and summary.stats["shards_committed"] == len(SHARD_SIZES)
    assert read == []  # no input shard is read
    assert "the rows of prompts no longer in the job are dropped: short" in caplog.text
    assert job_rows(out) == of(before, "caption", "refine")
    # With worker processes: one of them reports each shard's end.
    again = run(config(job_dir, "removed", prompts(CAPTION), "preprocess.workers=2"), loaded_fp32)
    assert engine_requests == [] and again.stats["shards_committed"] == len(SHARD_SIZES)
    assert job_rows(out) == of(before, "caption")
    marker = read_marker(out, "part-2.parquet")
    assert (marker.rows, marker.ok, marker.errors) == (4, 4, 0)
    assert [p["name"] for p in marker.config["prompts"]] == ["caption"]


def test_a_change_that_defines_every_row_is_still_refused_naming_it(job_dir, loaded_fp32):
    run(config(job_dir, "refused"), loaded_fp32)
    changed = config(job_dir, "refused", "preprocess.max_pixels=40000", prompts(CAPTION))
    with pytest.raises(UserError, match=r"\(changed: preprocess.max_pixels\); rerun with --overwrite"):
        run(changed, loaded_fp32)


def test_a_prompts_changed_sampling_runs_that_prompt_alone(job_dir, loaded_fp32, engine_requests):
    out = LocalDir(str(job_dir / "own-sampling"))
    run(config(job_dir, "own-sampling"), loaded_fp32)
    before = job_rows(out)
    engine_requests.clear()

    changed = prompts(CAPTION, "{name: short, text: One word., sampling: {max_new_tokens: 2}}", REFINE)
    run(config(job_dir, "own-sampling", changed), loaded_fp32)
    assert engine_requests == [1] * (SAMPLES - 1)  # short's, of each decodable image
    after = job_rows(out)
    assert of(after, "caption", "refine") == of(before, "caption", "refine")  # every value, latency_s too
    assert {row["num_output_tokens"] for row in of(after, "short") if row["status"] == "ok"} <= {1, 2}
    assert without_latency(after) == without_latency(fresh_rows(job_dir, loaded_fp32, "own", changed))


def test_a_job_wide_sampling_change_runs_the_prompts_that_do_not_set_that_key_themselves(
    job_dir, loaded_fp32, engine_requests
):
    name = "job-wide-sampling"
    out = LocalDir(str(job_dir / name))
    run(config(job_dir, name), loaded_fp32)
    before = job_rows(out)
    engine_requests.clear()
    # The job's own value set in a prompt defines the same rows: nothing runs.
    own = prompts(CAPTION, "{name: short, text: One word., sampling: {max_new_tokens: 5}}", REFINE)
    run(config(job_dir, name, own), loaded_fp32)
    assert engine_requests == [] and job_rows(out) == before

    changed = [own, "sampling.max_new_tokens=3"]
    expected = {
        "caption": RowCounts(0, SAMPLES),
        "short": RowCounts(SAMPLES, 0),  # keeps its own 5
        "refine": RowCounts(0, SAMPLES),
    }
    assert job_status(config(job_dir, name, *changed)).rows_per_prompt == expected
    settings = [arg for setting in [f"output.dir={name}", *changed] for arg in ("--set", setting)]
    validated = batchvl("validate", "job.yaml", *settings, cwd=job_dir)
    assert validated.returncode == 0, validated.stderr
    assert validated.stdout.endswith(
        "per prompt, what a run would do:\n"
        f"  caption: 0 row(s) reused, {SAMPLES} to compute\n"
        f"  short: {SAMPLES} row(s) reused, 0 to compute\n"
        f"  refine: 0 row(s) reused, {SAMPLES} to compute\n"
    )

    run(config(job_dir, name, *changed), loaded_fp32)
    assert sorted(engine_requests) == [0] * (SAMPLES - 1) + [2] * (SAMPLES - 1)
    after = job_rows(out)
    assert of(after, "short") == of(before, "short")  # every value, latency_s too
    assert all(row["num_output_tokens"] <= 3 for row in of(after, "caption", "refine"))
    assert without_latency(after) == without_latency(fresh_rows(job_dir, loaded_fp32, name, *changed))


def test_split_tasks_on_s3_keep_the_unchanged_rows_of_their_own_shards(
    job_dir, loaded_fp32, engine_requests, s3
):
    endpoint, _ = s3  # its bucket `data`
    prefix = f"s3://data/reuse-{uuid.uuid4().hex}"
    options = f"{{endpoint_url: '{endpoint}', key: testing, secret: testing}}"
    settings = [f"output.storage_options={options}"]
    out = open_output_dir(prefix, {"endpoint_url": endpoint, "key": "testing", "secret": "testing"})
    run(config(job_dir, prefix, *settings), loaded_fp32)
    before = job_rows(out)
    engine_requests.clear()

    changed = prompts(CAPTION, "{name: short, text: Two words.}", REFINE)
    for index in range(2):
        run(config(job_dir, prefix, *settings, changed), loaded_fp32, TaskSlice(index, 2))
    assert engine_requests == [1] * (SAMPLES - 1)
    after = job_rows(out)
    assert of(after, "caption", "refine") == of(before, "caption", "refine")
    assert without_latency(after) == without_latency(fresh_rows(job_dir, loaded_fp32, "s3", changed))
    body = out.read_bytes(out.join("part-0.parquet"))
    assert pq.read_table(io.BytesIO(body)).num_rows == 3 * SHARD_SIZES[0]


def test_status_and_validate_say_per_prompt_how_many_rows_a_run_would_reuse_and_compute(job_dir, loaded_fp32):
    changed = prompts(
        CAPTION, "{name: short, text: Two words.}", REFINE, "{name: extra, text: Name a colour.}"
    )
    fresh = job_status(config(job_dir, "counted", changed))
    assert fresh.rows_per_prompt == dict.fromkeys(
        ["caption", "short", "refine", "extra"], RowCounts(0, SAMPLES)
    )
    run(config(job_dir, "counted"), loaded_fp32)

    status = job_status(config(job_dir, "counted", changed), num_tasks=2)
    assert status.rows_per_prompt == {
        "caption": RowCounts(SAMPLES, 0),
        "short": RowCounts(0, SAMPLES),
        "refine": RowCounts(SAMPLES, 0),
        "extra": RowCounts(0, SAMPLES),
    }
    assert sum(task.other_prompts for task in status.tasks) == len(SHARD_SIZES) and status.shards_done == 0
    text = format_status(status, "job.yaml")
    assert f"  short: 0 row(s) reused, {SAMPLES} to compute" in text
    assert "3 shard(s) were written with other prompts or sampling; a run keeps the rows of the" in text
    assert json.loads(status_json(status))["rows_per_prompt"]["caption"] == {"reuse": SAMPLES, "compute": 0}

    validated = batchvl("validate", "job.yaml", "--set", "output.dir=counted", "--set", changed, cwd=job_dir)
    assert validated.returncode == 0, validated.stderr
    counted = "0 shard(s) committed as the job defines them, 3 committed with other prompts, 0 to run whole"
    assert f"counted ({counted})" in validated.stdout
    assert validated.stdout.endswith(
        "per prompt, what a run would do:\n"
        f"  caption: {SAMPLES} row(s) reused, 0 to compute\n"
        f"  short: 0 row(s) reused, {SAMPLES} to compute\n"
        f"  refine: {SAMPLES} row(s) reused, 0 to compute\n"
        f"  extra: 0 row(s) reused, {SAMPLES} to compute\n"
    )

    run(config(job_dir, "counted", changed), loaded_fp32)
    done = job_status(config(job_dir, "counted", changed))
    assert set(done.rows_per_prompt.values()) == {RowCounts(SAMPLES, 0)} and done.shards_done == 3


def test_on_the_openai_backend_only_the_changed_prompt_is_sent_to_the_server(tmp_path, tiny_model_dir):
    with FakeOpenAIServer(str(tiny_model_dir)) as server:
        job = server_jobs.write_job(tmp_path, tiny_model_dir, server_jobs.at(server.url))
        server_jobs.run(job)
        out = LocalDir(str(tmp_path / "out"))
        before = [row for n in range(2) for row in table_rows(out, f"part-{n}.parquet")]
        server.requests.clear()

        changed = (
            "prompts=[{name: caption, text: 'Describe {key}.'}, {name: short, text: 'Two words for {key}.'}]"
        )
        summary = server_jobs.run(job, changed)
    sent = [request.text for request in server.requests if request.path.endswith("/chat/completions")]
    sent = [text for text in sent if "{key}" not in text and " for s" in text]  # not the server's probe
    assert not [text for text in server_texts(server) if text.startswith("Describe")]
    assert sorted(sent) == sorted(
        f"Two words for s{n}-{i}." for n, size in enumerate([3, 2]) for i in range(size)
    )
    assert summary.stats["shards_committed"] == 2
    after = [row for n in range(2) for row in table_rows(out, f"part-{n}.parquet")]
    assert of(after, "caption") == of(before, "caption")
    assert all("Two words for" in row["text"] for row in of(after, "short"))  # the fake server echoes it


def server_texts(server) -> list[str]:
    return [request.text for request in server.requests if request.path.endswith("/chat/completions")]


RECOMMIT_WRITES = ["marker naming the old", "output", "companion", "marker"]


@pytest.mark.parametrize("crash_at", range(len(RECOMMIT_WRITES)), ids=RECOMMIT_WRITES)
def test_a_run_that_crashes_committing_a_shard_again_leaves_every_row_once_and_the_rerun_ends_it(
    job_dir, loaded_fp32, crash_at
):
    name = f"crash-{crash_at}"
    out = LocalDir(str(job_dir / name))
    batch = "output.format=openai_batch"  # a file made from each shard: the commit has all four writes
    run(config(job_dir, name, batch), loaded_fp32)
    before = job_rows(out)
    changed = prompts(CAPTION, "{name: short, text: Two words.}", REFINE)
    shard = "part-1.parquet"  # the second shard committed again; the first is done by then
    targets = {marker_path(out, shard), output_path(out, shard), batch_output_path(out, shard)}
    writes, write = [], LocalDir.write_bytes

    def write_or_crash(self, location: str, data: bytes) -> None:
        if location in targets:
            writes.append(location)
            if len(writes) == crash_at + 1:
                raise Crash(RECOMMIT_WRITES[crash_at])
        write(self, location, data)

    with pytest.MonkeyPatch.context() as patch, pytest.raises(Crash):
        patch.setattr(LocalDir, "write_bytes", write_or_crash)
        run(config(job_dir, name, batch, changed), loaded_fp32)

    # Each shard is the old one or the new one, every (sample, prompt) of its marker's config once.
    for number, size in enumerate(SHARD_SIZES):
        marker = read_marker(out, f"part-{number}.parquet")
        names = [prompt["name"] for prompt in marker.config["prompts"]]
        rows = table_rows(out, f"part-{number}.parquet")
        assert [(r["sample_index"], r["prompt"]) for r in rows] == [
            (i, p) for i in range(size) for p in names
        ]
    short = read_marker(out, shard).config["prompts"][1]["text"]
    assert short == ("Two words." if RECOMMIT_WRITES[crash_at] in ("companion", "marker") else "One word.")

    run(config(job_dir, name, batch, changed), loaded_fp32)
    after = job_rows(out)
    assert of(after, "caption", "refine") == of(before, "caption", "refine")
    assert without_latency(after) == without_latency(fresh_rows(job_dir, loaded_fp32, name, changed))
    assert read_marker(out, shard).replaces is None


def test_the_committed_rows_a_follow_up_uses_are_read_once_per_shard_when_its_first_sample_asks(
    job_dir, loaded_fp32, monkeypatch
):
    run(config(job_dir, "lazy"), loaded_fp32)
    out = LocalDir(str(job_dir / "lazy"))
    cfg = config(job_dir, "lazy", prompts(CAPTION, "{name: shorter, continue: caption, text: Shorter.}"))
    graph = PromptGraph.of(cfg.prompts)
    marker = read_marker(out, "part-2.parquet")
    reuse = prompt_reuse(graph, output_definition(cfg)[0], marker)
    reads = []
    read = prompt_reuse_module.read_committed
    monkeypatch.setattr(prompt_reuse_module, "read_committed", lambda *a: reads.append(a) or read(*a))

    selected = RowsToRun(out, "part-2.parquet", reuse, graph)
    assert (list(selected), reads) == ([0, 1, 2, 3], [])  # planning reads no file
    assert (
        selected[1].prompts == {1}
        and selected[1].used[0].text == table_rows(out, "part-2.parquet")[3]["text"]
    )
    assert selected[3].used[0].sample_index == 3 and len(reads) == 1
    ledger = ShardLedger([ShardInfo("part-2.parquet", "", 4)], {"part-2.parquet": selected}, 2)
    ledger.mark_committed("part-2.parquet")
    assert ledger.selection == {"part-2.parquet": {}}  # its rows go with the shard


OLDER_MARKER_FIELDS = [
    "shard",
    "fingerprint",
    "config",
    "rows",
    "ok",
    "errors",
    "errors_by_type",
    "task",
    "skipped",
    "host",
    "written_at",
    "batchvl_version",
    "retries",
    "output_bytes",
    "output_sha256",
]


def test_shards_committed_before_rows_were_reused_are_reused_the_same_way(
    job_dir, loaded_fp32, engine_requests
):
    out = LocalDir(str(job_dir / "older"))
    run(config(job_dir, "older"), loaded_fp32)
    before = job_rows(out)
    for number in range(len(SHARD_SIZES)):  # the marker earlier versions wrote and read: no new field
        marker = json.loads(out.read_text(marker_path(out, f"part-{number}.parquet")))
        assert set(marker) == set(OLDER_MARKER_FIELDS)
    engine_requests.clear()

    run(config(job_dir, "older", prompts(CAPTION, "{name: short, text: Two words.}", REFINE)), loaded_fp32)
    assert engine_requests == [1] * (SAMPLES - 1)
    assert of(job_rows(out), "caption", "refine") == of(before, "caption", "refine")


def test_a_prompt_that_inserted_a_removed_prompts_output_runs_again_on_the_field_of_that_name(
    tmp_path, tiny_model_dir, loaded_fp32, engine_requests
):
    """`{caption}` inserted prompt caption's output; without that prompt it inserts the sample's caption
    column, so refine's text is unchanged but its rows are not."""
    images = [png_bytes(random_image(40 + 8 * i, 50, seed=i)) for i in range(3)]
    table = pa.table({"key": ["a", "b", "c"], "image": images, "caption": ["a cat", "a dog", "a bird"]})
    (tmp_path / "data").mkdir()
    pq.write_table(table, tmp_path / "data" / "part-0.parquet")
    job_yaml = f"""
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts: [{CAPTION}, {REFINE}]
sampling: {{max_new_tokens: 5}}
preprocess: {{workers: 0}}
output: {{dir: out}}
"""
    (tmp_path / "job.yaml").write_text(job_yaml)
    run(load_job_config(tmp_path / "job.yaml"), loaded_fp32)
    engine_requests.clear()
    (tmp_path / "job.yaml").write_text(job_yaml.replace(f"[{CAPTION}, {REFINE}]", f"[{REFINE}]"))
    run(load_job_config(tmp_path / "job.yaml"), loaded_fp32)
    assert engine_requests == [0, 0, 0]  # refine, now on the caption column
    rows = table_rows(LocalDir(str(tmp_path / "out")), "part-0.parquet")
    fresh = load_job_config(tmp_path / "job.yaml", ["output.dir=fresh"])
    run(fresh, loaded_fp32)
    assert without_latency(rows) == without_latency(
        table_rows(LocalDir(str(tmp_path / "fresh")), "part-0.parquet")
    )


def test_a_run_and_validate_say_how_many_rows_are_kept_and_whose_are_dropped(job_dir, loaded_fp32):
    run(config(job_dir, "announced"), loaded_fp32)
    removed = ["--set", "output.dir=announced", "--set", prompts(CAPTION, REFINE)]
    validated = batchvl("validate", "job.yaml", *removed, cwd=job_dir)
    assert validated.returncode == 0, validated.stderr
    shards = len(SHARD_SIZES)
    counted = f"0 shard(s) committed as the job defines them, {shards} committed with other prompts"
    assert f"({counted}, 0 to run whole)" in validated.stdout
    kept = f"{2 * SAMPLES} committed row(s) of unchanged prompts"
    gone = f"dropped: the rows of prompts no longer in the job: short ({SAMPLES} row(s))"
    assert f"a run keeps: {kept}; {gone}\n" in validated.stdout

    ran = batchvl("run", "job.yaml", *removed, cwd=job_dir)
    assert ran.returncode == 0, ran.stderr
    assert f"kept: {kept}; {gone}\n" in ran.stdout
    newest = sorted((job_dir / "announced" / "_batchvl" / "stats").glob("run-*.json"))[-1]
    stats = json.loads(newest.read_text())
    assert (stats["rows_kept"], stats["rows_dropped"]) == (2 * SAMPLES, {"short": SAMPLES})


def test_a_column_no_prompt_writes_any_more_goes_when_its_prompt_stops_being_scored(job_dir, loaded_fp32):
    scored = "{name: short, text: One word., choices: [red, blue], choice_mode: score}"
    run(config(job_dir, "unscored", prompts(CAPTION, scored)), loaded_fp32)
    out = LocalDir(str(job_dir / "unscored"))
    assert "choice_probs" in table_rows(out, "part-0.parquet")[0]

    run(config(job_dir, "unscored", prompts(CAPTION, SHORT)), loaded_fp32)
    rows = job_rows(out)
    assert all("choice_probs" not in row for row in rows)
    fresh = fresh_rows(job_dir, loaded_fp32, "unscored", prompts(CAPTION, SHORT))
    assert without_latency(of(rows, "short")) == without_latency(of(fresh, "short"))
