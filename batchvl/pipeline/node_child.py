"""What one engine process of a node runs: the ordinary run (`JobRunner`) of the job, as one more
concurrent run of it, splitting the shards with its siblings through the claims. It tells the launcher
(`node.py`) through its pipe: ("samples", index, n) as samples finish, then ("ended", index, stats, why)
once, with why None for a finished run, or (message, exit code) for a stop or the error budget; a run
that failed says ("failed", index, message, exit code) and ends (with its traceback on stderr where the
failure is not a mistake of the job's). A process whose launcher is gone (killed) fails at its next
message, its pipe broken, leaving its unfinished shards to the rerun as a killed run does."""

from __future__ import annotations

import logging
import sys
import time
from multiprocessing.connection import Connection

from batchvl.config import JobConfig
from batchvl.errors import JobEnded, UserError
from batchvl.pipeline.tasks import TaskSlice

SEND_EVERY_S = 0.2  # the launcher's one bar needs a few updates a second, not one message per sample


class SampleCounter:
    """Counts finished samples and sends them in batches."""

    def __init__(self, messages: Connection, index: int):
        self.messages = messages
        self.index = index
        self.unsent = 0
        self.sent_at = time.monotonic()

    def __call__(self) -> None:
        self.unsent += 1
        if time.monotonic() - self.sent_at >= SEND_EVERY_S:
            self.flush()

    def flush(self) -> None:
        if self.unsent:
            self.messages.send(("samples", self.index, self.unsent))
            self.unsent = 0
        self.sent_at = time.monotonic()


class SiblingClaims(logging.Filter):
    """Leaves out the notice of a shard skipped because another run holds it: in a node, the siblings hold
    half the shards, and the node's summary counts the shards held by runs outside it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "skipping %s: %s" and str(record.args[1]).startswith("another run has it"))


def run_child(
    index: int, cfg: JobConfig, task: TaskSlice | None, log_level: int, messages: Connection
) -> None:
    """The target of process `index` (started with multiprocessing's spawn: nothing inherited)."""
    logging.basicConfig(
        level=log_level,
        format=f"%(asctime)s %(levelname)s process {index}: %(name)s: %(message)s",
        stream=sys.stderr,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(SiblingClaims())
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # as the command sets it: transformers' notices are noise, N times over
    hf_logging.disable_progress_bar()  # the launcher's bar is the node's one
    from batchvl.pipeline.runner import JobRunner

    counter = SampleCounter(messages, index)
    runner = JobRunner(cfg, None, False, task, count_sample=counter, write_stats=False)
    try:
        summary = runner.run()
        why = None
    except JobEnded as ended:
        summary, why = ended.summary, (str(ended), ended.exit_code)
    except UserError as error:  # a mistake found while reading: one line, exit 2, as for a single run
        messages.send(("failed", index, str(error), 2))
        sys.exit(2)
    except BaseException as error:
        messages.send(("failed", index, f"{type(error).__name__}: {error}", 1))
        raise
    finally:
        counter.flush()
    messages.send(("ended", index, summary.stats if summary is not None else None, why))
