"""The parts of a node's launch that need no processes: where each process runs and its share of the cores
(`--gpus` on a machine that says it has GPUs), and how the processes' stats add up."""

import os
from types import SimpleNamespace

import pytest
import torch

from batchvl.config import job_config_from_dict
from batchvl.errors import ErrorBudgetExceeded, ProcessDied, UserError
from batchvl.pipeline import node
from batchvl.pipeline.ending import RunSummary
from batchvl.pipeline.node_places import Place, node_places, process_config
from batchvl.pipeline.node_stats import node_stats


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_gpus_gives_each_process_its_own_gpu(two_gpus):
    assert node_places(None, "all") == [Place(0, "0"), Place(1, "1")]
    assert node_places(None, "1") == [Place(0, "0")]


def test_gpus_counts_the_visible_gpus_and_names_them_as_cuda_visible_devices_does(two_gpus, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert node_places(None, "2") == [Place(0, "4"), Place(1, "6")]


@pytest.mark.parametrize(
    ("gpus", "fragment"),
    [
        ("3", "--gpus 3: this machine has 2 CUDA device(s); give 2 or fewer, or all"),
        ("0", "--gpus must be a number of GPUs, 1 or more, or all; got '0'"),
        ("two", "--gpus must be a number of GPUs, 1 or more, or all; got 'two'"),
    ],
)
def test_more_gpus_than_the_machine_has_or_no_number_is_refused(two_gpus, gpus, fragment):
    with pytest.raises(UserError, match="^" + fragment.replace("(", r"\(").replace(")", r"\)")):
        node_places(None, gpus)


def test_a_gpus_value_that_is_no_number_is_named_as_such_on_a_machine_without_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="^--gpus must be a number of GPUs, 1 or more, or all; got 'x'$"):
        node_places(None, "x")
    with pytest.raises(UserError, match="^--gpus 2: no CUDA device is available; on the CPU use --processes"):
        node_places(None, "2")


@pytest.mark.parametrize("processes", [0, "2", 2.0, True])
def test_processes_must_be_a_whole_number_of_one_or_more(processes):
    with pytest.raises(UserError, match="^--processes must be a whole number, 1 or more, got "):
        node_places(processes, None)


def job(tmp_path, **sections):
    return job_config_from_dict(
        {
            "model": {"path": str(tmp_path), "device": "auto"},
            "input": {"paths": ["data/*.parquet"]},
            "prompts": [{"name": "caption", "text": "Describe this image."}],
            "output": {"dir": "out"},
            **sections,
        },
        tmp_path,
    )


def test_each_process_takes_its_device_and_an_even_share_of_the_cores(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    cfg = job(tmp_path)
    on_gpu = process_config(cfg, Place(1, "1"), 2)  # 8 cores each: half for workers, half for threads
    assert (on_gpu.model.device, on_gpu.preprocess.workers, on_gpu.engine.threads) == ("cuda", 4, 4)
    assert Place(1, "1").device(cfg) == "cuda:1"
    on_cpu = process_config(cfg, Place(0), 8)  # 2 cores each
    assert (on_cpu.model.device, on_cpu.preprocess.workers, on_cpu.engine.threads) == ("auto", 1, 1)
    assert process_config(cfg, Place(0), 32).engine.threads == 1  # more processes than cores: one each


def test_processes_sharing_one_gpu_each_take_a_share_of_its_free_memory(tmp_path, monkeypatch):
    cfg = job(
        tmp_path, model={"path": str(tmp_path), "device": "cuda"}, engine={"gpu_memory_utilization": 0.8}
    )
    assert process_config(cfg, Place(0), 2).engine.gpu_memory_utilization == 0.4  # --processes 2 on one GPU
    assert process_config(cfg, Place(0), 1).engine.gpu_memory_utilization == 0.8
    assert process_config(cfg, Place(1, "1"), 2).engine.gpu_memory_utilization == 0.8  # --gpus: one each
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    on_cpu = job(tmp_path, engine={"gpu_memory_utilization": 0.8})  # model.device auto, no GPU
    assert process_config(on_cpu, Place(0), 2).engine.gpu_memory_utilization == 0.8


def test_the_jobs_own_workers_and_threads_are_each_processs(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    cfg = job(tmp_path, preprocess={"workers": 3}, engine={"threads": 5})
    each = process_config(cfg, Place(0), 2)
    assert (each.preprocess.workers, each.engine.threads) == (3, 5)


def test_a_gpu_process_sees_only_its_gpu_and_the_launcher_keeps_its_environment(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    with node._sees_only("6"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,6"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with node._sees_only("1"):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ


def run(samples, wait, processing, errors=None, ranks=(1, 2)):
    return {
        "mode": "run",
        "samples": samples,
        "shards_committed": samples // 2,
        "output_tokens": 10 * samples,
        "input_wait_s": wait,
        "input_wait_share": round(wait / processing, 4),
        "preprocess_workers": 1,
        "processing_s": processing,
        "wall_s": processing + 3,
        "errors_by_type": errors or {},
        "encode_tokens_per_rank": list(ranks),
        "vit_parallel_ranks": 1,
        "stopped_by": None,
    }


def test_the_processes_counts_add_their_times_are_the_longest_and_each_keeps_its_wait():
    zero = run(0, 0.0, 1.0, ranks=())  # what a run that counted nothing reports
    stats = node_stats(
        zero,
        [
            run(6, 1.0, 4.0, {"image_decode_error": 1}),
            run(2, 3.0, 2.0, {"image_decode_error": 2, "x": 1}),
            None,
        ],
        ["cuda:0", "cuda:1", "cuda:2"],
        [0, 0, -9],
        [10.0, 12.0, None],  # the first processed from 6 to 10, the second from 10 to 12
    )
    assert (stats["samples"], stats["shards_committed"], stats["output_tokens"]) == (8, 4, 80)
    assert stats["errors_by_type"] == {"image_decode_error": 3, "x": 1}
    assert stats["encode_tokens_per_rank"] == [2, 4]
    assert (stats["processing_s"], stats["wall_s"], stats["vit_parallel_ranks"]) == (6.0, 7.0, 1)
    assert stats["samples_per_s"] == round(8 / 6, 3) and stats["output_tokens_per_s"] == round(80 / 6, 3)
    assert stats["input_wait_s"] == 4.0 and stats["input_wait_share"] == round(4.0 / (6.0 * 3), 4)
    assert stats["processes"] == [
        {
            "device": "cuda:0",
            "exit_code": 0,
            "samples": 6,
            "shards_committed": 3,
            "input_wait_s": 1.0,
            "input_wait_share": 0.25,
            "preprocess_workers": 1,
        },
        {
            "device": "cuda:1",
            "exit_code": 0,
            "samples": 2,
            "shards_committed": 1,
            "input_wait_s": 3.0,
            "input_wait_share": 1.5,
            "preprocess_workers": 1,
        },
        {"device": "cuda:2", "exit_code": -9},  # died before it could say
    ]


def ended(failures=None, reported=(True, True), errors=0, before=None):
    outcome = node._Node(2)
    outcome.ended = list(reported)
    outcome.failures = failures or {}
    stats = {"shards_committed": 3, "shards_total": 4, "shards_skipped": 0, "rows_not_committed": 0}
    stats["rows_committed_before"] = before or {"ok": 0, "errors": 0, "skipped": 0}
    summary = RunSummary("out", "stats.json", {**stats, "ok": 10 - errors, "errors": errors, "skipped": 0})
    cfg = SimpleNamespace(output=SimpleNamespace(max_error_rate=0.25))
    return lambda: node._raise_unless_finished(
        cfg, summary, outcome, ["cpu", "cpu"], [0, 1], node.NodeStop([])
    )


def test_a_mistake_found_while_reading_is_the_commands_one_line_exit_2():
    with pytest.raises(UserError, match="^column 'key' is missing$"):
        ended({1: ("column 'key' is missing", node.MISTAKE)}, (True, False))()


def test_a_process_that_failed_is_named_with_its_error():
    with pytest.raises(
        ProcessDied, match=r"^process 1 \(cpu\) failed: RuntimeError: boom; the other"
    ) as died:
        ended({1: ("RuntimeError: boom", 1)}, (True, False))()
    assert died.value.exit_code == 1 and died.value.summary.stats["shards_committed"] == 3


def test_the_error_budget_is_held_over_the_nodes_rows_and_those_committed_before():
    ended(errors=2)()  # 2 of 10: within 0.25
    with pytest.raises(ErrorBudgetExceeded):
        ended(errors=3)()
    # 2 of 10 here, 4 of 6 committed by earlier runs: 6 of 16 is over 0.25
    with pytest.raises(
        ErrorBudgetExceeded, match=r"^6 of 16 rows .* \(6 of the rows are of shards committed"
    ):
        ended(errors=2, before={"ok": 2, "errors": 4, "skipped": 0})()
    ended(errors=2, before={"ok": 6, "errors": 0, "skipped": 0})()  # 2 of 16: within


def test_when_every_process_died_none_is_said_to_have_finished():
    with pytest.raises(ProcessDied, match=r"\(cpu\) died with exit code 1; no process finished \(3 shard"):
        ended({}, (False, False))()
