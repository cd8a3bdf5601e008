"""The `batchvl` command: each subcommand parses its arguments and calls one library function.

Known mistakes (`UserError`) print one line and exit 2; set BATCHVL_DEBUG=1 to see the traceback. An
output file the OS would not write (`OutputWriteFailed`: a full disk) is one line too, exit 1.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Annotated

import typer

from batchvl import __version__
from batchvl.errors import JobEnded, OutputWriteFailed, StopOverdue, UserError

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_show_locals=False,
    no_args_is_help=True,
    help="Batch captioning and visual question answering with vision-language models.",
)

JobFile = Annotated[Path, typer.Argument(help="Job file (YAML).", show_default=False)]
SetOption = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a job key: section.key=value (repeatable).", show_default=False),
]
LogLevel = Annotated[str, typer.Option("--log-level", help="Logging level: debug, info, warning or error.")]

# Recent Typer releases raise usage errors from their own copy of click, older ones from click itself:
# the base class to catch is the one Typer's own BadParameter derives from, whichever copy that is.
UsageErrors = next(base for base in typer.BadParameter.__mro__ if base.__name__ == "ClickException")


def _print_version(requested: bool) -> None:
    if requested:
        typer.echo(f"batchvl {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    pass  # Typer takes the options before a command here; --version acts in its own callback


LOG_LEVELS = ("debug", "info", "warning", "error")


def _setup_logging(level: str) -> None:
    from batchvl.utils.versions import check_library_versions

    if level.lower() not in LOG_LEVELS:
        raise typer.BadParameter(f"--log-level must be one of {', '.join(LOG_LEVELS)}; got {level!r}")

    check_library_versions()  # every command passes here before any work
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # transformers' own progress bars and notices are noise in a batch job's log.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


@app.command()
def run(
    job_file: JobFile,
    set_: SetOption = None,
    shard: Annotated[
        str | None,
        typer.Option(
            "--shard",
            help="Run task I of N (I/N, from 0): a balanced, deterministic slice of the input shards. "
            "Under a Slurm array the task's environment gives it.",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[
        bool, typer.Option("--overwrite", help="Recompute committed shards, even ones from another config.")
    ] = False,
    requeue: Annotated[
        bool,
        typer.Option(
            "--requeue",
            help="Under Slurm: after a clean stop on SIGUSR1 (time limit near), requeue this task.",
        ),
    ] = False,
    gpus: Annotated[
        str | None,
        typer.Option(
            "--gpus",
            help="One engine process per GPU, N GPUs or all, splitting the job's shards.",
            metavar="N|all",
            show_default=False,
        ),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            "--processes",
            help="N engine processes on the job's model.device (on the CPU: N engines over its cores).",
            show_default=False,
        ),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    log_level: LogLevel = "warning",
) -> None:
    """Run a job: caption / answer every (sample, prompt) and write one Parquet file per input shard."""
    _setup_logging(log_level)
    from batchvl.commands.slurm import requeue_this_task
    from batchvl.config import load_job_config
    from batchvl.pipeline.node import run_node
    from batchvl.pipeline.node_places import node_places
    from batchvl.pipeline.runner import run_job
    from batchvl.pipeline.tasks import parse_task_slice, slurm_task_slice

    places = node_places(processes, gpus)  # before the job is even read: a wrong flag is refused first
    overrides = [*(set_ or []), *(["output.overwrite=true"] if overwrite else [])]
    cfg = load_job_config(job_file, overrides)
    task = parse_task_slice(shard) if shard is not None else slurm_task_slice()
    try:
        if places is None:
            summary = run_job(cfg, show_progress=progress, task=task)
        else:
            summary = run_node(cfg, places, show_progress=progress, task=task)
    except JobEnded as ended:  # a stop or the error budget: the same report, then the reason and its code
        if ended.summary is not None:
            _echo_summary(ended.summary)
        typer.echo(f"batchvl: {ended}", err=True)
        if requeue and ended.exit_code == 128 + signal.SIGUSR1:
            requeue_this_task()  # last: Slurm ends this process as part of the requeue
        sys.exit(ended.exit_code)
    if summary.is_driver:
        _echo_summary(summary)
    else:  # a rank that only served ViT encode rounds has nothing to report
        _end_serving_rank()


def _end_serving_rank() -> None:
    """A serving rank ends here, once it has left the process group: it writes nothing, so the
    interpreter's teardown has nothing to finish. Two 2-rank test runs in about forty ended with this rank
    aborted ("terminate called without an active exception") after its rounds, which torchrun reports as
    the whole job failing; the abort was not reproduced to prove where it comes from, and ending without
    the teardown leaves nothing for it to happen in."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _echo_summary(summary) -> None:
    s = summary.stats
    task_note = f"task {s['task']}: " if s.get("task") else ""
    verb = "stopped" if s.get("stopped_by") else "done"
    typer.echo(
        f"{task_note}{verb}: {s['samples']} samples, {s['ok']} ok, {s['errors']} errors, "
        + (f"{s['skipped']} skipped, " if s.get("skipped") else "")
        + f"{s['shards_committed']} shard(s) written, {s['shards_skipped']} already done; "
        f"{s['samples_per_s']} samples/s, {s['output_tokens_per_s']} output tok/s"
    )
    if s.get("encoder_disk_hits") or s.get("encoder_disk_writes"):
        typer.echo(
            f"encoder disk cache: {s['encoder_disk_hits']} image(s) read from it, "
            f"{s['encoder_disk_writes']} encoded and written to it"
        )
    if s.get("shards_claimed_elsewhere"):
        typer.echo(
            f"skipped: {s['shards_claimed_elsewhere']} shard(s) another run had; "
            "`batchvl status` shows when they are done"
        )
    if s.get("rows_kept") or s.get("rows_dropped"):
        typer.echo(_kept_and_dropped(s["rows_kept"], s["rows_dropped"], "kept"))
    for number, process in enumerate(s.get("processes", ())):
        typer.echo(
            f"process {number} ({process['device']}): "
            + (
                f"{process['samples']} samples, {process['shards_committed']} shard(s) written, "
                f"waited {process['input_wait_s']} s for input"
                if "samples" in process
                else f"ended without its stats (exit code {process['exit_code']})"
            )
        )
    if s.get("rows_not_committed"):
        typer.echo(
            f"not committed: {s['rows_not_committed']} row(s) of unfinished shards, redone by the next run"
        )
    typer.echo(f"output: {summary.output_dir}")
    typer.echo(f"stats: {summary.stats_path}")


def _kept_and_dropped(kept: int, dropped: dict[str, int], verb: str) -> str:
    """The committed rows a run keeps (prompts unchanged) and drops (prompts no longer in the job)."""
    line = f"{verb}: {kept} committed row(s) of unchanged prompts"
    if dropped:
        gone = ", ".join(f"{name} ({rows} row(s))" for name, rows in sorted(dropped.items()))
        line += f"; dropped: the rows of prompts no longer in the job: {gone}"
    return line


@app.command()
def validate(job_file: JobFile, set_: SetOption = None, log_level: LogLevel = "warning") -> None:
    """Check everything `run` checks before it works (job file, model, prompt constraints, input schemas,
    output folder), and list the input shards; runs nothing and writes nothing."""
    _setup_logging(log_level)
    from batchvl.config import load_job_config
    from batchvl.pipeline.plan import plan_job

    cfg = load_job_config(job_file, set_ or [])
    plan = plan_job(cfg)
    typer.echo(f"job file ok: {job_file}")
    typer.echo(f"model: {cfg.model.path} ({plan.model_type})")
    typer.echo(f"prompts: {', '.join(p.name for p in cfg.prompts)}")
    counts = [s.num_rows for s in plan.listing]
    total = f"{sum(counts)} samples" if None not in counts else "sample count known after reading"
    typer.echo(f"input ({cfg.input.format}): {len(plan.listing)} shard(s), {total}")
    for shard in plan.listing:
        rows = "?" if shard.num_rows is None else shard.num_rows
        typer.echo(f"  {shard.shard}  {rows} samples")
    resume = plan.resume
    whole = len(resume.pending) - len(resume.reuse)
    typer.echo(
        f"output: {cfg.output.dir} ({resume.num_done} shard(s) committed as the job defines them, "
        f"{len(resume.reuse)} committed with other prompts, {whole} to run whole)"
    )
    if resume.reuse:
        typer.echo(_kept_and_dropped(resume.rows_kept(), resume.rows_dropped(), "a run keeps"))
    typer.echo("per prompt, what a run would do:")
    for name, counts in plan.resume.rows_per_prompt(plan.graph.names).items():
        typer.echo(f"  {name}: {counts.describe()}")


@app.command("retry-failed")
def retry_failed_command(
    job_file: JobFile,
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="Override a key for the retry only, e.g. preprocess.max_pixels=4000000 (repeatable).",
            show_default=False,
        ),
    ] = None,
    shard: Annotated[
        str | None,
        typer.Option("--shard", help="Retry only task I of N's shards (I/N).", show_default=False),
    ] = None,
    progress: Annotated[bool, typer.Option(help="Show a progress bar.")] = True,
    log_level: LogLevel = "warning",
) -> None:
    """Rerun only the error rows of committed shards and merge the new rows back into them."""
    _setup_logging(log_level)
    from batchvl.commands.retry import retry_failed
    from batchvl.config import load_job_config
    from batchvl.pipeline.tasks import parse_task_slice, slurm_task_slice

    job = load_job_config(job_file)
    retry = load_job_config(job_file, set_ or [])
    task = parse_task_slice(shard) if shard is not None else slurm_task_slice()
    summary = retry_failed(job, retry, list(set_ or []), show_progress=progress, task=task)
    s = summary.stats
    typer.echo(
        f"retried {s['requests']} error row(s) in {s['shards_committed']} shard(s): {s['ok']} ok now, "
        f"{s['errors']} still errors"
    )
    if s["shards_not_committed"]:
        typer.echo(
            f"note: {s['shards_not_committed']} shard(s) are not committed yet; `batchvl run` them first"
        )
    typer.echo(f"output: {summary.output_dir}")


@app.command()
def slurm(
    job_file: JobFile,
    array: Annotated[int, typer.Option("--array", help="Number of array tasks N (task I runs --shard I/N).")],
    submit: Annotated[bool, typer.Option("--submit", help="Submit the script with sbatch.")] = False,
    sbatch_arg: Annotated[
        list[str] | None,
        typer.Option(
            "--sbatch-arg",
            help="An #SBATCH option for every task, e.g. --sbatch-arg=--time=04:00:00 (repeatable).",
            show_default=False,
        ),
    ] = None,
    signal_lead_s: Annotated[
        int,
        typer.Option("--signal-lead", help="Seconds before the time limit that SIGUSR1 asks a task to stop."),
    ] = 300,
    script_dir: Annotated[
        Path | None,
        typer.Option(
            help="Local folder for the script and the task logs (default: output.dir; for an object-store "
            "output.dir, ./batchvl-slurm/<its last name>).",
            show_default=False,
        ),
    ] = None,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            help="GPUs per task (--gres=gpu:N): one engine process per GPU, or a launched server's GPUs.",
            show_default=False,
        ),
    ] = None,
    processes: Annotated[
        int | None,
        typer.Option(
            "--processes", help="Engine processes per task, on the job's device.", show_default=False
        ),
    ] = None,
    set_: SetOption = None,
) -> None:
    """Write an sbatch script for a Slurm array job running `batchvl run` (and submit it with --submit)."""
    _setup_logging("warning")
    from batchvl.commands.slurm import ArrayJob, check_node_options, check_script_options, write_array_job
    from batchvl.commands.slurm import submit as sbatch_submit
    from batchvl.config import is_remote, load_job_config
    from batchvl.pipeline.node import check_node
    from batchvl.pipeline.plan import plan_job

    check_node_options(gpus, processes)
    check_script_options(array, signal_lead_s, list(sbatch_arg or []))
    cfg = load_job_config(job_file, set_ or [])
    server_takes_gpus = cfg.engine.backend == "openai" and cfg.engine.server.launch is not None
    if processes is not None or (gpus is not None and not server_takes_gpus):
        check_node(cfg)  # what a node's processes cannot run, refused before the script is written
    plan = plan_job(cfg)  # the tasks' own preflight, before anything is submitted
    num_shards = len(plan.listing)
    if script_dir is None and is_remote(cfg.output.dir):
        script_dir = Path("batchvl-slurm", cfg.output.dir.rstrip("/").rsplit("/", 1)[-1])
    job = ArrayJob(
        job_file=str(job_file.resolve()),
        out_dir=cfg.output.dir,
        files_dir=str(script_dir.resolve()) if script_dir else "",
        num_tasks=array,
        overrides=list(set_ or []),
        sbatch_args=list(sbatch_arg or []),
        signal_lead_s=signal_lead_s,
        gpus=gpus,
        processes=processes,
        server_takes_gpus=server_takes_gpus and gpus is not None,
    )
    script = write_array_job(job, plan.out)
    typer.echo(f"wrote {script} ({array} task(s) over {num_shards} input shard(s); logs in {job.log_dir})")
    if array > num_shards:
        typer.echo(f"note: {array - num_shards} task(s) will have no shard to run")
    if submit:
        typer.echo(f"submitted Slurm job {sbatch_submit(script)}")
    else:
        typer.echo(f"submit: sbatch {script}")


@app.command()
def status(
    job_file: JobFile,
    tasks: Annotated[
        int | None,
        typer.Option(
            help="Tasks N the job is split into (default: the array `batchvl slurm` wrote, or the runs').",
            show_default=False,
            min=1,
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the status as JSON.")] = False,
    set_: SetOption = None,
) -> None:
    """Report shards done / pending, rows ok / error, per-task throughput, and how to rerun the rest."""
    _setup_logging("warning")
    from batchvl.commands.status import format_status, job_status, status_json
    from batchvl.config import load_job_config

    cfg = load_job_config(job_file, set_ or [])
    report = job_status(cfg, tasks)
    if json_output:
        typer.echo(status_json(report))
    else:
        typer.echo(format_status(report, str(job_file)))


@app.command()
def report(
    job_file: JobFile,
    set_: SetOption = None,
    samples: Annotated[int, typer.Option(help="Inputs shown in the gallery (a seeded random choice).")] = 24,
    seed: Annotated[int, typer.Option(help="Seed of the gallery's choice.")] = 0,
    out: Annotated[
        str | None,
        typer.Option(
            help="Where to write the page, a path or a URL (default: output.dir/report.html).",
            metavar="PATH",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Write a self-contained HTML page: run stats, token-length plots, a gallery and every error row."""
    _setup_logging("warning")
    from batchvl.commands.report.page import write_report
    from batchvl.config import load_job_config

    if samples < 0:
        raise typer.BadParameter(f"--samples must be 0 or more, got {samples}")
    cfg = load_job_config(job_file, set_ or [])
    path, written = write_report(cfg, out, samples, seed)
    typer.echo(
        f"report: {path} ({written.rows} rows, {written.errors} errors, "
        f"{written.gallery_samples} in the gallery)"
    )


@app.command()
def export(
    job_file: JobFile,
    set_: SetOption = None,
    wide: Annotated[
        str | None,
        typer.Option(
            help="Write the labels: one row per sample, a typed column per prompt (a path or a URL).",
            metavar="PATH",
            show_default=False,
        ),
    ] = None,
    rows: Annotated[
        str | None,
        typer.Option(
            help="Write every committed row, one per (sample, prompt), in one file (a path or a URL).",
            metavar="PATH",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Write the job's committed results as one Parquet file: the labels (--wide) or the rows (--rows)."""
    _setup_logging("warning")
    from batchvl.commands.labels import job_rows, labels_table, ran_output_dir, table_notes
    from batchvl.config import load_job_config
    from batchvl.outputs.writers import parquet_bytes
    from batchvl.storage.output_dir import write_file

    if wide is None and rows is None:
        raise UserError("export: name a file with --wide OUT.parquet (labels) or --rows OUT.parquet (rows)")
    if wide is not None and rows is not None and _same_file(wide, rows):
        raise UserError(f"export: --wide and --rows both name {wide}; give each its own file")
    cfg = load_job_config(job_file, set_ or [])
    inside = [path for path in (rows, wide) if path is not None and _within(path, cfg.output.dir)]
    if inside:
        raise UserError(
            f"export: {inside[0]} is inside output.dir {cfg.output.dir}, whose files are the job's own (a "
            "committed shard's would be replaced); write the export elsewhere"
        )
    ran_output_dir(cfg)
    table = job_rows(cfg)
    labels = labels_table(cfg, table) if wide is not None else None
    for path, written in ((rows, table), (wide, labels)):
        if path is not None:
            write_file(path, parquet_bytes(written), cfg.output.storage_options)
            typer.echo(f"wrote {path} ({written.num_rows} rows)")
    for note in table_notes(labels) if labels is not None else ():
        typer.echo(f"note: {note}")


def _same_file(one: str, other: str) -> bool:
    where = [_where(path) for path in (one, other)]
    return where[0] == where[1]


def _within(path: str, folder: str) -> bool:
    return _where(path).startswith(_where(folder) + "/")


def _where(path: str) -> str:
    from batchvl.config import is_remote

    return path.rstrip("/") if is_remote(path) else os.path.realpath(path)


@app.command("make-tiny-model")
def make_tiny_model(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write the checkpoint to.", show_default=False)],
    family: Annotated[
        str,
        typer.Option(
            help="Model family: qwen2_vl, qwen2_5_vl, qwen3_vl, llava, idefics3, smolvlm or internvl."
        ),
    ] = "qwen2_vl",
    size: Annotated[
        str,
        typer.Option(
            help="tiny (tests, seconds), thin (tiny's layers, the real images' sizes), deep (tiny's widths, "
            "Qwen2-VL-2B's depth), small (~90M params, "
            "benchmarks), wide (Qwen2-VL-2B's widths), 2b or 7b (Qwen2-VL-2B's or -7B's whole "
            "configuration: 2.2B or 8.3B parameters, gigabytes), 256m (SmolVLM2-256M's whole configuration; "
            "with --family smolvlm)."
        ),
    ] = "tiny",
    seed: Annotated[int, typer.Option(help="Seed for tokenizer corpus and weights.")] = 0,
) -> None:
    """Build a random-weight checkpoint locally (no hub needed). It writes meaningless text."""
    _setup_logging("warning")
    from batchvl.demo.tiny_model import build_tiny_model

    path = build_tiny_model(_folder_to_write(out_dir), family=family, size=size, seed=seed)
    typer.echo(f"wrote {family} ({size}) to {path}")


@app.command("make-sample-data")
def make_sample_data(
    out_dir: Annotated[Path, typer.Argument(help="Folder to write Parquet shards to.", show_default=False)],
    num_shards: Annotated[int, typer.Option(help="Number of Parquet shards.", min=1)] = 2,
) -> None:
    """Write a small dataset of real photos (scikit-image's samples) at varied sizes as Parquet shards."""
    from batchvl.demo.sample_data import write_sample_data

    paths = write_sample_data(_folder_to_write(out_dir), num_shards=num_shards)
    typer.echo(f"wrote {len(paths)} shard(s) to {out_dir}")


def _folder_to_write(folder: Path) -> Path:
    """`folder`, made if need be; one that is a file or cannot be made is refused in one line."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{folder} is a file; give a folder to write to")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(
            f"{folder} cannot be made ({exc.strerror or exc}); give a folder that can be written"
        ) from None
    return folder


INTERRUPTED = 130  # 128 + SIGINT, as shells report a job stopped by Ctrl-C


def main() -> None:
    try:
        # Outside standalone mode Typer turns Ctrl-C into a returned exit code instead of raising.
        if app(standalone_mode=False) == INTERRUPTED:
            typer.echo("interrupted", err=True)
            sys.exit(INTERRUPTED)
    except UserError as exc:
        if os.environ.get("BATCHVL_DEBUG"):
            traceback.print_exc()  # the same exit code: scripts that test for 2 must not change behaviour
        typer.echo(f"error: {exc}", err=True)
        sys.exit(2)
    except JobEnded as ended:
        typer.echo(f"batchvl: {ended}", err=True)
        sys.exit(ended.exit_code)
    except OutputWriteFailed as failed:  # the environment, not a bug: no traceback
        typer.echo(f"batchvl: {failed}", err=True)
        sys.exit(failed.EXIT_CODE)
    except StopOverdue as overdue:
        typer.echo(f"batchvl: {overdue}", err=True)
        sys.exit(128 + overdue.signum)
    except UsageErrors as exc:  # an unknown command or option, a missing argument or value: exit 2
        exc.show()
        sys.exit(exc.exit_code)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        typer.echo("aborted", err=True)
        sys.exit(INTERRUPTED)
