"""The throughput benchmark's batchvl method (c): `batchvl run`'s jobs, one per part of the workload, in
the benchmark's child process after the model is loaded; with the openai backend's settings, the same jobs
against a server (method f, `server_method.py`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from processes import since_process_start
from throughput_workload import PROMPTS, read_part, workload_parts

# The jobs' stats summed over the workload's parts (the row check compares `ok` and `errors` with the
# rows in the output Parquet).
SUMMED_STATS = (
    "output_tokens",
    "images_encoded",
    "patches_encoded",
    "prefill_tokens_computed",
    "encode_s",
    "forward_s",
    "input_wait_s",
    "processing_s",
    "ok",
    "errors",
)


def batchvl_job(
    data: Path,
    names: list[str],
    out: Path,
    model: dict,
    engine: dict | None = None,
    sampling: dict | None = None,
):
    """The job of one part of the workload; `model`: its model section (path, dtype, device); `sampling`:
    keys added to its sampling section (greedy without)."""
    from batchvl.config import job_config_from_dict

    return job_config_from_dict(
        {
            "model": model,
            "input": {"paths": [str(data / "*.parquet")], "key_column": "key"},
            "prompts": [{"name": name, "text": PROMPTS[name]} for name in names],
            "sampling": {"max_new_tokens_field": "budget", "ignore_eos": True, **(sampling or {})},
            "output": {"dir": str(out), "overwrite": True},
            **({"engine": engine} if engine else {}),
        }
    )


def run_batchvl(
    root: Path, model_dir: str, dtype_name: str, engine: dict | None = None, device: str = "cpu"
) -> dict:
    """batchvl's own engine, or with `engine` (the openai backend's settings) a server's."""
    from batchvl.models.loader import load_model
    from batchvl.pipeline.runner import run_job

    model = {"path": model_dir, "dtype": dtype_name, "device": device}

    def job(data: Path, names: list[str], out: Path):
        return batchvl_job(data, names, out, model, engine)

    # Start-up: loading the model and a job of the workload's first sample, as a user's first result.
    parts = workload_parts(root)
    first_part, first_names = next(iter(parts.items()))
    first = root / "startup" / dtype_name
    first.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(read_part(root, first_part)[:1]), first / "part-0.parquet")
    loaded = None if engine else load_model(model_dir, dtype=dtype_name, device=device)
    run_job(job(first, first_names, first / "out"), loaded=loaded, show_progress=False)
    startup = since_process_start()

    def run_parts(out: Path) -> list[tuple[str, list[str], dict]]:
        """The workload's jobs, one per part, writing under `out`: (part, its prompts, the job's stats)."""
        return [
            (part, names, run_job(job(root / "data" / part, names, out / part), loaded=loaded,
                                  show_progress=False).stats)
            for part, names in parts.items()
        ]  # fmt: skip

    totals: dict = {"startup_s": startup}
    wall = 0.0
    for _, _, stats in run_parts(root / "out" / dtype_name):
        wall += stats["wall_s"]
        for key in SUMMED_STATS:
            totals[key] = totals.get(key, 0) + stats[key]
        totals["engine_replicas"] = stats["engine_replicas"]
    if loaded is not None:
        # The same jobs again in this process (new engines, so no cache carries over): the rate once every
        # oneDNN kernel the workload needs is built, which a long job reaches and a fresh one does not.
        warm = run_parts(root / "warm" / dtype_name)
        for part, names, stats in warm:
            if stats["errors"] or stats["ok"] != len(names) * len(read_part(root, part)):
                raise SystemExit(
                    f"batchvl's warm run of {part} wrote {stats['ok']} ok, {stats['errors']} error rows"
                )
        totals["warm_wall_s"] = sum(stats["wall_s"] for _, _, stats in warm)
    # The rows as written (after the clock): what the row check counts.
    rows = [
        [row["key"], row["prompt"], row["status"], row["error_message"]]
        for part in parts for path in sorted((root / "out" / dtype_name / part).glob("*.parquet"))
        for row in pq.read_table(path, columns=["key", "prompt", "status", "error_message"]).to_pylist()
    ]  # fmt: skip
    return {"wall_s": wall, **totals, "rows": rows}
