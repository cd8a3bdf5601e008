"""Exceptions that carry a user-facing, one-line message.

`UserError` is a mistake the user can fix (bad job file, wrong path, unknown model family): the CLI
prints its message on one line and exits with code 2. `SampleError` is bad input for one sample: it
becomes an error row (`status="error"`) and the job goes on. `JobEnded` is a run that committed what
it could and stopped early on purpose (a signal, the error budget): the CLI prints its message and
exits with its code. `OutputWriteFailed` is an output file the OS would not write: one line, exit 1.
"""

from __future__ import annotations

from typing import Literal

# A row's outcome: its text (`ok`), why it has none (`error`, with a type from ERROR_TYPES), or that its
# follow-up prompt did not run (`skipped`, its error_message saying why).
RowStatus = Literal["ok", "error", "skipped"]

# Every `error_type` a row can carry, with its cause: the stable names users filter on. The table in
# docs/output.md is generated from this (`error_types_markdown_table`), and a test checks that every
# SampleError the code raises names a type listed here. `<code>` stands for an HTTP status.
ERROR_TYPES: dict[str, str] = {
    "empty_image": "an image of zero bytes",
    "empty_video": "a video of zero bytes",
    "image_decode_error": "not an image, truncated JPEG/PNG, unreadable data",
    "image_too_small": "an image with no pixels (a width or height of 0) that the decoder opens (a PNG "
    "whose header says 0 is refused by the decoder itself: `image_decode_error`)",
    "image_too_large": "more pixels than `preprocess.max_image_pixels` (checked from the header, before "
    "decoding; Pillow's own decompression-bomb guard follows the same limit), or a downloaded body over "
    "`input.download.max_bytes`",
    "video_too_large": "a video whose frames exceed `preprocess.max_image_pixels`",
    "extreme_aspect_ratio": "more elongated than 200:1 (e.g. 1x2000)",
    "video_decode_error": "not a video, no video stream, no decodable frame",
    "video_unsupported": "a video where PyAV, which decodes it, is not installed (`pip install av`)",
    "unsupported_media": "a video given to a family that takes images only, or a media cell batchvl does not "
    "read as media (a number, an array kept as lists of numbers: cast it to datasets' `Image` feature)",
    "file_not_found": "a media path or object that does not exist, or a tar member linking to one the tar "
    "does not hold",
    "path_outside_root": "a media path that leads outside `input.root` (absolute elsewhere, up with `..`, "
    "or through a symbolic link)",
    "not_a_file": "a media path that is a directory, a named pipe or a device (a tar member that is a pipe "
    "or a device)",
    "missing_image": "a row or tar sample without media",
    "bad_json": "a WebDataset `json` member that does not parse",
    "truncated_shard": "the last sample read from a damaged tar file (the samples before it are kept)",
    "unreadable_rows": "a row of a Parquet row group that cannot be read (a damaged page): a row each, keyed "
    "by its index; the file's other row groups are read",
    "missing_field": "the prompt uses a field the sample lacks (or `sampling.max_new_tokens_field` holds "
    "no positive integer)",
    "prompt_mismatch": "the rendered prompt's media placeholders do not match the sample's media (a "
    "prompt or field that holds the model's own image or video token)",
    "context_too_long": "prompt plus media over the model's context (refused before prefill)",
    "kv_cache_too_small": "the request cannot fit in `engine.kv_cache_mb`",
    "image_exceeds_chunk": "with `engine.disable_chunked_mm_input`, an image larger than one step's token "
    "budget",
    "incomplete_output": "a constrained output ended (token limit, stop string) before it was complete; "
    "`text` keeps it",
    "invalid_output": "a finished output, as written (after a stop string is cut), that does not validate "
    "against its `json_schema`, match its `regex` or equal one of its `choices`; `text` keeps it",
    "dependency_failed": "a follow-up prompt whose input prompt failed (the message names it); "
    "`retry-failed` reruns it",
    "download_http_<code>": "an image URL answered with that HTTP status (429 and 5xx after "
    "`input.download.retries`)",
    "download_timeout": "an image URL that did not answer in time (`input.download.timeout_s`, "
    "`total_timeout_s`)",
    "download_error": "an image URL that is malformed, could not be reached (DNS, refused connection) or "
    "read",
    "download_redirect_loop": "an image URL that redirected in a loop, or more than "
    "`input.download.max_redirects` times",
    "url_not_allowed": "an image URL resolving to an address that is not public: loopback, private, "
    "link-local, shared, reserved (`input.download.allow_private`), or of a protocol batchvl does not fetch",
    "bad_request": "an `openai_batch` line that is malformed (not JSON, no custom_id or messages, a "
    "custom_id an earlier line has, a schema that cannot be used)",
    "unsupported_request": "an `openai_batch` line that asks for what batchvl does not do (another "
    "endpoint, tools, `n` > 1, audio, log-probabilities in the output)",
    "server_rejected": "the server (engine.backend: openai) refused the request with an HTTP 4xx (an image "
    "its processor refuses, a prompt over its context); the message is the server's",
    "server_error": "the server failed the request (a timeout, HTTP 429 or 5xx) after "
    "`engine.server.retries`, or gave an answer batchvl cannot use, while it answered others; "
    "`retry-failed` reruns it",
    "server_crash": "the server stopped answering (died or hung) each time this request was sent, the "
    "last times alone, after `engine.server.retries`; the rest of the job went on",
    "preprocess_crash": "the preprocessing worker died on this sample",
    "preprocess_timeout": "the sample's preprocessing (its downloads included) exceeded "
    "`preprocess.timeout_s`",
    "preprocess_error": "any other exception while preprocessing (the message has the exception)",
}


def error_types_markdown_table() -> str:
    lines = ["| `error_type` | cause |", "|---|---|"]
    lines += [f"| `{error_type}` | {cause} |" for error_type, cause in ERROR_TYPES.items()]
    return "\n".join(lines)


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type's name where it has none): a library's
    multi-line message as the reason in a one-line refusal."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class UserError(Exception):
    """A mistake in how batchvl was called; the message names the problem and the fix."""


class ConfigError(UserError):
    """The job file (or a --set override) is invalid."""


class SampleError(Exception):
    """One sample (or one request) cannot be processed; it becomes an error row."""

    def __init__(self, error_type: str, message: str):
        super().__init__(message)
        self.error_type = error_type
        self.message = message

    def __reduce__(self):
        # Crosses process boundaries (preprocessing workers): rebuild from both fields, not from args.
        return (SampleError, (self.error_type, self.message))


class JobEnded(Exception):
    """The run stopped early after committing every complete shard; `exit_code` says why, `summary`
    holds what the run did (the job's RunSummary), for the same report a finished run gives."""

    def __init__(self, message: str, exit_code: int, summary: object | None = None):
        super().__init__(message)
        self.exit_code = exit_code
        self.summary = summary


class StoppedBySignal(JobEnded):
    """SIGINT, SIGTERM or SIGUSR1 arrived: the run stopped after the current step. Exit code 128 + signal."""


class ErrorBudgetExceeded(JobEnded):
    """More error rows than `output.max_error_rate` allows. Exit code 3."""

    EXIT_CODE = 3


class ProcessDied(JobEnded):
    """One of a node's engine processes (`--gpus`, `--processes`) died (killed, out of memory) or failed:
    the others finished, its unfinished shards are left for the rerun of the same command. Exit code 1."""

    EXIT_CODE = 1


class ServerGone(Exception):
    """The server backend's server stopped answering every request (after the retries, and restarts of a
    server batchvl launched): the run stops, and the requests it failed on are never written as rows."""


class ServerUnavailable(JobEnded):
    """The run stopped because its server went away, after committing every shard finished before. Exit
    code 1; the same command resumes against a live server."""

    EXIT_CODE = 1


class OutputWriteFailed(OSError):
    """The OS refused to write a file of the output (a full disk, a file-size limit, a lost mount). It names
    the file: a failed write names none. A run ends there with what it committed before intact (a commit
    writes its marker last), and the same command goes on from it once the file can be written. The CLI
    prints the message on one line and exits 1, as for a server that went away."""

    EXIT_CODE = 1

    def __str__(self) -> str:
        return f"cannot write {self.filename}: {self.strerror} (errno {self.errno})"


class StopOverdue(BaseException):
    """A run given a stop signal had not stopped within its grace period and was interrupted wherever it
    was. A BaseException, like KeyboardInterrupt, so that no handler of one sample's errors takes it for
    that sample's and carries on. The CLI exits with 128 + the signal's number, as for a clean stop."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
