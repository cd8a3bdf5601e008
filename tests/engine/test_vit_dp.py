"""ViT data parallelism: the LPT split, and a real 2-process torchrun job equal to a 1-process one."""

import io
import json
import os
import re
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchvl.utils.balance import lpt_assignment
from tests.conftest import random_image, two_prompt_job_yaml


def test_lpt_gives_each_image_to_the_least_loaded_rank_largest_first():
    counts = [10, 40, 30, 20, 20, 5]
    shares = lpt_assignment(counts, 2)
    # 40 -> r0, 30 -> r1, 20 -> r1 (30 < 40), 20 -> r0 (40 < 50), 10 -> r1 (50 < 60), 5 -> r0 (tie: lowest)
    assert shares == [[1, 4, 5], [2, 3, 0]]
    assert sorted(i for share in shares for i in share) == list(range(len(counts)))  # each exactly once
    loads = [sum(counts[i] for i in share) for share in shares]
    assert loads == [65, 60]


def test_lpt_with_more_ranks_than_images_and_one_rank():
    assert lpt_assignment([3, 9], 4) == [[1], [0], [], []]
    assert lpt_assignment([3, 9, 1], 1) == [[1, 0, 2]]
    assert lpt_assignment([], 3) == [[], [], []]


def png(seed: int, height: int, width: int) -> bytes:
    buffer = io.BytesIO()
    random_image(height, width, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def run(args: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


@pytest.fixture(scope="module")
def dp_job(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("vitdp")
    (root / "data").mkdir()
    sizes = [(40, 60), (200, 150), (90, 90), (120, 300), (30, 30), (160, 100), (70, 220), (50, 50)]
    images = [png(seed, h, w) for seed, (h, w) in enumerate(sizes)]
    images.append(images[1])  # a duplicate is still encoded once
    pq.write_table(
        pa.table({"key": [f"k{i}" for i in range(len(images))], "image": images}), root / "data" / "s.parquet"
    )
    (root / "job.yaml").write_text(
        two_prompt_job_yaml(
            tiny_model_dir, "{max_num_batched_tokens: 512, vit_parallel: data}", "preprocess: {workers: 1}"
        )
    )
    return root


@pytest.mark.timeout(1500)  # two runs, each limited to 600 s
def test_two_rank_vit_data_parallel_job_equals_one_process(dp_job):
    single = run(
        [sys.executable, "-m", "batchvl", "run", "job.yaml", "--no-progress", "--set", "output.dir=one"],
        dp_job,
    )
    assert single.returncode == 0, single.stderr
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    parallel = run([*launch, "-m", "batchvl", "run", "job.yaml", "--no-progress"], dp_job)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    assert parallel.stdout.count("done:") == 1  # rank 0 reports; rank 1 only served encode rounds

    one = pq.read_table(dp_job / "one" / "s.parquet").to_pylist()
    two = pq.read_table(dp_job / "out" / "s.parquet").to_pylist()
    drop = ("latency_s",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in two] == [
        {k: v for k, v in r.items() if k not in drop} for r in one
    ]
    assert all(r["status"] == "ok" for r in two) and len(two) == 18

    (stats_file,) = (dp_job / "out" / "_batchvl" / "stats").glob("run-*.json")
    stats = json.loads(stats_file.read_text())
    assert stats["vit_parallel_ranks"] == 2 and stats["images_encoded"] == 8
    per_rank = stats["patches_encoded_per_rank"]
    assert sum(per_rank) == stats["patches_encoded"] and min(per_rank) > 0


@pytest.mark.timeout(900)  # a torchrun job, limited to 600 s
def test_torchrun_without_vit_parallel_is_a_one_line_mistake(dp_job):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    result = run([*launch, "-m", "batchvl", "run", "job.yaml", "--set", "engine.vit_parallel=none"], dp_job)
    assert result.returncode != 0
    # each rank prints batchvl's one-line message and exits 2 (torchrun then reports the failed ranks)
    assert "error: launched as 2 processes (WORLD_SIZE=2) but engine.vit_parallel is 'none'" in result.stderr
    assert re.search(r"exitcode\s*:\s*2\b", result.stderr)
