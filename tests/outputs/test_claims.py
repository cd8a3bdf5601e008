"""Shard claims: concurrent runs of one job split its shards; claims of dead holders are taken over."""

import json
import os
import socket
import subprocess
import sys
import time

import psutil
import pyarrow as pa
import pyarrow.parquet as pq

from batchvl.config import config_fingerprint, job_config_from_dict, output_defining_config
from batchvl.outputs.claims import STALE_S, Holder, ShardClaims
from batchvl.outputs.commit import read_marker
from batchvl.pipeline.commit_strategies import WriteShard
from batchvl.pipeline.runner import JobRunner
from batchvl.storage.output_dir import LocalDir
from tests.conftest import png_bytes, random_image


def exited_process_holder() -> Holder:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    holder = Holder.of_process(child.pid)
    child.wait()
    return holder


def test_a_claim_is_held_until_released_and_a_dead_holders_claim_is_taken_over(tmp_path):
    ours = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getpid()))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(sleeper.pid))
        assert theirs.acquire("a/part-0.parquet") is None
        assert theirs.acquire("a/part-0.parquet") is None  # ours already: still ours
        assert ours.acquire("a/part-0.parquet") == theirs.holder  # a live holder keeps it
        ours.release("a/part-0.parquet")  # not ours: left alone
        assert ours.acquire("a/part-0.parquet") == theirs.holder
        theirs.release("a/part-0.parquet")
        assert ours.acquire("a/part-0.parquet") is None
    finally:
        sleeper.kill()
        sleeper.wait()
    dead = ShardClaims(LocalDir(str(tmp_path)), exited_process_holder())
    assert dead.acquire("b.parquet") is None
    assert ours.acquire("b.parquet") is None  # its process is gone: stale, taken over
    with open(ours.path("b.parquet")) as claim:
        assert json.load(claim)["pid"] == os.getpid()


def test_a_claim_naming_a_live_pid_that_another_process_now_has_is_stale(tmp_path):
    ours = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getpid()))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        started = psutil.Process(sleeper.pid).create_time()
        # the claim of a run that had this pid before: same host and pid, an earlier start
        before = ShardClaims(
            LocalDir(str(tmp_path)), Holder(socket.gethostname(), sleeper.pid, started - 3600)
        )
        assert before.acquire("s.parquet") is None
        assert ours.acquire("s.parquet") is None  # taken over although the pid is alive
        with open(ours.path("s.parquet")) as claim:
            assert json.load(claim)["pid"] == os.getpid()
        ours.release("s.parquet")
        now = ShardClaims(LocalDir(str(tmp_path)), Holder(socket.gethostname(), sleeper.pid, started))
        assert now.acquire("s.parquet") is None
        assert ours.acquire("s.parquet") == now.holder  # the pid's own process keeps its claim
    finally:
        sleeper.kill()
        sleeper.wait()


def test_another_hosts_claim_is_live_until_its_heartbeat_is_old(tmp_path):
    ours = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getpid()))
    remote = ShardClaims(LocalDir(str(tmp_path)), Holder(f"not-{socket.gethostname()}", 1, 0.0))
    assert remote.acquire("s.parquet") is None
    assert ours.acquire("s.parquet") == remote.holder
    old = time.time() - STALE_S - 5
    os.utime(remote.path("s.parquet"), (old, old))
    remote.refresh(["s.parquet"], every_s=0)  # a live remote holder refreshes its claim
    assert ours.acquire("s.parquet") == remote.holder
    os.utime(remote.path("s.parquet"), (old, old))  # and one that stopped refreshing loses it
    assert ours.acquire("s.parquet") is None


def claim_in(folder, shard: str) -> Holder:
    return Holder(**json.loads((folder / "_batchvl" / "claims" / f"{shard}.lock").read_text()))


def test_of_two_runs_that_judged_one_claim_stale_only_the_first_to_take_it_over_gets_the_shard(
    tmp_path, monkeypatch
):
    dead = ShardClaims(LocalDir(str(tmp_path)), exited_process_holder())
    first = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getpid()))
    second = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getppid()))
    assert dead.acquire("s.parquet") is None
    judge = first._is_stale
    judged = []

    def second_takes_over_once_first_judged(path, holder):
        stale = judge(path, holder)
        if not judged:  # between the first's judging the dead claim stale and its taking it over
            assert holder == dead.holder and stale
            assert second.acquire("s.parquet") is None
        judged.append(holder)
        return stale

    monkeypatch.setattr(first, "_is_stale", second_takes_over_once_first_judged)
    assert first.acquire("s.parquet") == second.holder  # the second's fresh claim is not taken
    assert judged == [dead.holder, second.holder]
    assert claim_in(tmp_path, "s.parquet") == second.holder
    assert sorted(os.listdir(tmp_path / "_batchvl" / "claims")) == ["s.parquet.lock"]


def lost_claim_and_taker(tmp_path):
    """Our claim (a run on another host) and a run here that takes it over once its heartbeat is old."""
    ours = ShardClaims(LocalDir(str(tmp_path)), Holder(f"not-{socket.gethostname()}", 1, 0.0))
    taker = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getpid()))
    assert ours.acquire("s.parquet") is None

    def take_over():
        old = time.time() - STALE_S - 5
        os.utime(ours.path("s.parquet"), (old, old))
        assert taker.acquire("s.parquet") is None

    return ours, taker, take_over


def test_a_release_leaves_the_claim_of_a_run_that_took_the_shard_over_after_it_was_read(
    tmp_path, monkeypatch
):
    ours, taker, take_over = lost_claim_and_taker(tmp_path)
    read = ours.out.read_bytes

    def taken_over_once_read(location):
        data = read(location)
        take_over()
        return data

    monkeypatch.setattr(ours.out, "read_bytes", taken_over_once_read)
    ours.release("s.parquet")
    assert claim_in(tmp_path, "s.parquet") == taker.holder
    assert sorted(os.listdir(tmp_path / "_batchvl" / "claims")) == ["s.parquet.lock"]


def test_a_heartbeat_leaves_the_claim_of_a_run_that_took_the_shard_over_after_it_was_read(
    tmp_path, monkeypatch
):
    ours, taker, take_over = lost_claim_and_taker(tmp_path)
    utime = os.utime
    old = int(time.time() - STALE_S / 2)

    def taken_over_first(*args, **kwargs):  # the takeover comes between reading the claim and touching it
        monkeypatch.setattr(os, "utime", utime)
        take_over()
        utime(taker.path("s.parquet"), (old, old))
        utime(*args, **kwargs)

    monkeypatch.setattr(os, "utime", taken_over_first)
    ours.refresh(["s.parquet"], every_s=0)
    assert claim_in(tmp_path, "s.parquet") == taker.holder
    assert os.path.getmtime(taker.path("s.parquet")) == old  # not refreshed by the run that lost it


def test_a_claim_moved_by_mistake_is_put_back_only_where_no_run_made_one_meanwhile(tmp_path, monkeypatch):
    ours, taker, take_over = lost_claim_and_taker(tmp_path)
    third = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getppid()))
    read, rename = ours.out.read_bytes, os.rename

    def third_claims_once_renamed(source, target):  # the taker's claim moved away: the path is free
        monkeypatch.setattr(os, "rename", rename)
        rename(source, target)
        assert third.acquire("s.parquet") is None

    def taken_over_once_read(location):
        data = read(location)
        take_over()
        monkeypatch.setattr(os, "rename", third_claims_once_renamed)
        return data

    monkeypatch.setattr(ours.out, "read_bytes", taken_over_once_read)
    ours.release("s.parquet")
    assert claim_in(tmp_path, "s.parquet") == third.holder  # not replaced by the taker's, put back
    assert sorted(os.listdir(tmp_path / "_batchvl" / "claims")) == ["s.parquet.lock"]


def test_a_live_holder_whose_start_time_reads_a_little_off_keeps_its_claim(tmp_path, monkeypatch):
    ours = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getpid()))
    theirs = ShardClaims(LocalDir(str(tmp_path)), Holder.of_process(os.getppid()))
    assert theirs.acquire("s.parquet") is None
    create_time = psutil.Process.create_time
    for seconds in (0.5, -0.5):  # boot time derived again from a stepped clock
        monkeypatch.setattr(
            psutil.Process, "create_time", lambda process, s=seconds: create_time(process) + s
        )
        assert ours.acquire("s.parquet") == theirs.holder
    monkeypatch.setattr(psutil.Process, "create_time", lambda process: create_time(process) + 5)
    assert ours.acquire("s.parquet") is None  # another process with that pid: stale, taken over
    assert claim_in(tmp_path, "s.parquet") == ours.holder


NUM_SHARDS = 16


def test_two_runs_of_one_job_split_the_shards_instead_of_both_doing_all(tmp_path, tiny_model_dir):
    (tmp_path / "data").mkdir()
    for number in range(NUM_SHARDS):
        images = [png_bytes(random_image(40 + i, 48, seed=10 * number + i)) for i in range(2)]
        pq.write_table(pa.table({"image": images}), tmp_path / "data" / f"part-{number:02d}.parquet")
    (tmp_path / "job.yaml").write_text(
        f"model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}\n"
        "input: {paths: [data/*.parquet]}\n"
        "prompts: [{name: caption, text: Describe this image.}, {name: short, text: One word.}]\n"
        "sampling: {max_new_tokens: 24, ignore_eos: true}\n"
        "engine: {max_num_seqs: 1, lookahead: 1}\n"
        "preprocess: {workers: 2}\n"
        "output: {dir: out}\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "batchvl", "run", "job.yaml", "--no-progress"]

    def start():
        return subprocess.Popen(
            command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    first, second = start(), start()  # each claims a shard as it starts reading it, not all at once
    for process in (first, second):
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr
    runs = [json.loads(p.read_text()) for p in (tmp_path / "out" / "_batchvl" / "stats").glob("run-*.json")]
    assert len(runs) == 2
    assert sum(run["shards_committed"] for run in runs) == NUM_SHARDS  # each shard done once
    assert sum(run["samples"] for run in runs) == 2 * NUM_SHARDS
    assert all(run["shards_committed"] > 0 for run in runs)  # both did work
    assert any(run["shards_claimed_elsewhere"] > 0 for run in runs)
    for number in range(NUM_SHARDS):
        shard = f"part-{number:02d}.parquet"
        assert read_marker(LocalDir(str(tmp_path / "out")), shard) is not None
        assert pq.read_table(tmp_path / "out" / shard).num_rows == 4
    assert list((tmp_path / "out" / "_batchvl" / "claims").iterdir()) == []  # every claim released


def test_a_shards_claim_is_released_when_it_commits_not_when_the_run_ends(
    tmp_path, tiny_model_dir, loaded_fp32
):
    (tmp_path / "data").mkdir()
    for number in range(3):
        image = png_bytes(random_image(40, 48, seed=number))
        pq.write_table(pa.table({"image": [image]}), tmp_path / "data" / f"part-{number}.parquet")
    cfg = job_config_from_dict(
        {
            "model": {"path": str(tiny_model_dir), "dtype": "float32", "device": "cpu"},
            "input": {"paths": ["data/*.parquet"]},
            "prompts": [{"name": "caption", "text": "Describe this image."}],
            "sampling": {"max_new_tokens": 2},
            "preprocess": {"workers": 0},
            "output": {"dir": "out"},
        },
        tmp_path,
    )
    claims = tmp_path / "out" / "_batchvl" / "claims"
    write = WriteShard(
        cfg, LocalDir(cfg.output.dir), None, output_defining_config(cfg), config_fingerprint(cfg)
    )
    seen = []  # (the shard being committed, the claims there are as it commits)

    def look_then_commit(info, rows):
        seen.append((info.shard, {path.name for path in claims.iterdir()}))
        return write(info, rows)

    look_then_commit.records_input_stamp = write.records_input_stamp
    JobRunner(cfg, loaded_fp32, show_progress=False, commit=look_then_commit).run()
    assert sorted(shard for shard, _ in seen) == ["part-0.parquet", "part-1.parquet", "part-2.parquet"]
    for i, (shard, held) in enumerate(seen):
        assert f"{shard}.lock" in held  # held while its shard is written
        for earlier, _ in seen[:i]:
            assert f"{earlier}.lock" not in held  # released at its commit, while the run went on
    assert list(claims.iterdir()) == []
