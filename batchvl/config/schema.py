"""The job file's sections, every key declared once with its type, default, help text and bounds; a
`JobConfig` checks itself when it is built, from a job file or in Python alike."""

from __future__ import annotations

import dataclasses
import functools
import re
import typing
from dataclasses import dataclass
from typing import Any, Literal

from batchvl.config.conversion import build, convert
from batchvl.config.keys import check_bounds, file_key, job_key
from batchvl.errors import ConfigError

# More than any machine has cores: a thread or worker count above it is a typo (engine.threads: 100000
# crashed the process as its threads started)
MOST_CORES = 1024


@dataclass(frozen=True)
class ModelConfig:
    path: str = job_key(help="Folder of a Hugging Face checkpoint (safetensors weights)", defines_output=True)
    dtype: Literal["float32", "bfloat16", "auto"] = job_key(
        "auto",
        "auto: bfloat16 on CUDA and on CPUs with AVX-512, else float32 (never float16 on CPU)",
        defines_output=True,
    )
    device: str = job_key(
        "auto",
        "cpu, cuda, cuda:N or auto (cuda when available, else cpu); under torchrun `cuda` is each rank's "
        "local GPU, rank i on GPU i % count",
    )
    trust_remote_code: bool = job_key(
        False, "Allow the checkpoint's own Python code to run", defines_output=True
    )


@dataclass(frozen=True)
class DownloadConfig:
    concurrency: int = job_key(8, "Downloads in flight at once, per preprocessing worker", above=0)
    timeout_s: float = job_key(
        10.0, "Connect timeout, and the longest wait for the next bytes of a response", above=0
    )
    total_timeout_s: float = job_key(
        60.0, "Longest one attempt at a download may take, however slowly the bytes come", above=0
    )
    max_bytes: int = job_key(
        50 * 2**20, "Largest body read; a larger one is an `image_too_large` error row", above=0
    )
    retries: int = job_key(
        3, "Further attempts after a timeout, a refused connection, HTTP 429 or 5xx", at_least=0
    )
    backoff_s: float = job_key(
        0.5, "Wait before the first retry, doubled for each later one (a Retry-After header wins)", at_least=0
    )
    max_redirects: int = job_key(5, "Most redirects followed for one URL", at_least=0)
    allow_private: bool = job_key(
        False,
        "Allow URLs that resolve to loopback, private or link-local addresses (refused by default: job "
        "files and datasets come from other people)",
    )
    cache_dir: str | None = job_key(
        None, "Keep downloaded bytes here (content-addressed), so retries and reruns do not download again"
    )


@dataclass(frozen=True)
class InputConfig:
    paths: list[str] = job_key(
        help="Glob patterns: Parquet files, tar files, `save_to_disk` folders or media folders (by format)"
    )
    format: Literal["parquet", "webdataset", "hf_dataset", "folder", "openai_batch"] = job_key(
        "parquet",
        "parquet: each file a shard; webdataset: tar shards; hf_dataset: each Arrow file a shard; "
        "folder: image/video files; openai_batch: JSONL files of chat-completion requests, each line "
        "with its own messages and sampling",
        defines_output=True,
    )
    image_column: str = job_key(
        "image",
        "Table column with image bytes, a {bytes, path} struct, a path, an http(s) URL, or a list of these",
        defines_output=True,
    )
    key_column: str | None = job_key(
        None,
        "Column used as the sample key (null: the row index; a row whose key is null gets its index)",
        defines_output=True,
    )
    root: str | None = job_key(
        None,
        "Folder that relative media paths in tables resolve against (null: the table file's folder)",
        defines_output=True,
    )
    files_per_shard: int = job_key(
        1000,
        "`folder` input: files per shard (the unit of output and resume); recorded shards keep their files",
        above=0,
        defines_output=True,
    )
    storage_options: dict = job_key(
        help="fsspec options for `s3://`, `gs://` ... input paths (credentials, endpoint_url); "
        "empty: the environment's, as fsspec finds them",
        factory=dict,
    )
    download: DownloadConfig = job_key(
        help="Image cells that are http(s) URLs: how they are fetched", factory=DownloadConfig
    )


@dataclass(frozen=True)
class WhenConfig:
    prompt: str = job_key(help="An earlier prompt whose output decides whether this prompt runs")
    equals: str | None = job_key(None, "Run when that output is exactly this")
    in_: list[str] | None = job_key(None, "Run when that output is one of these", name="in")


@dataclass(frozen=True)
class PromptConfig:
    name: str = job_key(
        help="Prompt name, written to the `prompt` column; not empty, and not a column of the labels "
        "(`shard`, `key`, `sample_index`, another prompt's name + `_status` / `_probs`)"
    )
    text: str = job_key(
        help="Prompt text after the sample's images in one user turn; "
        "`{field}` inserts a field of the sample, `{key}` its key, `{prompt}` an earlier prompt's output"
    )
    continue_: str | None = job_key(
        None,
        "An earlier prompt: this prompt is the next user turn of its conversation (its images and text, "
        "its output as the answer, then this text)",
        unset_leaves_fingerprint=True,
        name="continue",
    )
    when: WhenConfig | None = job_key(
        None,
        "Run only where an earlier prompt's output matches ({prompt, equals} or {prompt, in}); other "
        "samples get a `skipped` row",
        unset_leaves_fingerprint=True,
    )
    json_schema: dict | str | None = job_key(
        None,
        "JSON schema the output must follow, inline or a path to a .json file relative to the job file "
        "(the output is generated under it, and a row is ok only if it parses and validates)",
        unset_leaves_fingerprint=True,
    )
    json_whitespace: Literal["compact", "any"] = job_key(
        "compact",
        "json_schema output: compact (no whitespace between JSON tokens) or any whitespace",
        unset_leaves_fingerprint=True,
    )
    regex: str | None = job_key(
        None, "Regular expression the whole output must match", unset_leaves_fingerprint=True
    )
    choices: list[str] | None = job_key(
        None,
        "The output is exactly one of these strings, the most probable given the prompt "
        "(see choice_mode); its probability among the choices is in `choice_probs`",
        unset_leaves_fingerprint=True,
    )
    choice_mode: Literal["score", "generate"] = job_key(
        "score",
        "choices prompt: score every choice (teacher-forced, one short prefill each) or generate under "
        "the choices as a constraint (cheaper for hundreds of choices; no choice_probs)",
        unset_leaves_fingerprint=True,
    )
    # Read and checked as the `sampling` section's own keys are (`prompt_sampling`): one declaration each.
    sampling: dict | None = job_key(
        None,
        "This prompt's own sampling: any `sampling` key (same type and bounds) in place of the job-wide "
        "value, e.g. {temperature: 0.7, max_new_tokens: 64}; the keys it does not give are the job's",
        unset_leaves_fingerprint=True,
    )


@dataclass(frozen=True)
class SamplingConfig:
    max_new_tokens: int = job_key(128, "Most tokens generated per request", above=0)
    max_new_tokens_field: str | None = job_key(
        None,
        "Sample field (input column) holding a per-sample token limit, used instead of max_new_tokens "
        "(a null value falls back to max_new_tokens)",
    )
    temperature: float = job_key(0.0, "0 (or below 1e-5) = greedy", at_least=0)
    top_p: float = job_key(1.0, "Nucleus sampling mass (1 = off)", above=0, at_most=1)
    top_k: int = job_key(0, "Sample among the k most likely tokens (0 = off)", at_least=0)
    seed: int = job_key(0, "Base seed; each request derives its own from it, its shard, key and prompt")
    stop: list[str] = job_key(help="Stop strings (cut from the text)", factory=list)
    stop_token_ids: list[int] = job_key(help="Token ids that end generation", factory=list)
    ignore_eos: bool = job_key(False, "Keep generating past end-of-sequence tokens")
    logprobs: bool = job_key(
        False,
        "Add mean_logprob and min_logprob columns: over each row's output tokens, the log-probability of "
        "each token in the distribution it was chosen from",
        unset_leaves_fingerprint=True,
    )
    top_logprobs: int = job_key(
        0,
        "Add a top_logprobs column: per output token, this many most likely tokens with their "
        "log-probabilities (0: off)",
        at_least=0,
        at_most=20,
        unset_leaves_fingerprint=True,
    )


@dataclass(frozen=True)
class ServerConfig:
    url: str | None = job_key(
        None, "An OpenAI-compatible server that is running, e.g. http://127.0.0.1:8000/v1 (or set launch)"
    )
    launch: str | None = job_key(
        None,
        "A command that starts an OpenAI-compatible server, which batchvl runs for the job and stops after "
        'it, e.g. "python -m vllm.entrypoints.openai.api_server" (or set url)',
    )
    launch_args: list[str] = job_key(
        help="Arguments appended to `launch` (batchvl adds --model, --host, --port, --dtype and, with "
        "`model`, --served-model-name)",
        factory=list,
    )
    model: str | None = job_key(
        None,
        "The model name sent in requests (null: model.path, which must be the server's model)",
        unset_leaves_fingerprint=True,
    )
    max_concurrency: int = job_key(64, "Requests in flight at once", above=0)
    timeout_s: float = job_key(
        600.0, "Longest one request may take, from its connection to its answer's last byte", above=0
    )
    retries: int = job_key(
        3,
        "Further attempts after a refused connection, a timeout, HTTP 429 or 5xx (and restarts of a "
        "launched server that died)",
        at_least=0,
    )
    backoff_s: float = job_key(
        1.0, "Wait before the first retry, doubled for each later one (a Retry-After header wins)", at_least=0
    )
    max_retry_wait_s: float = job_key(
        300.0,
        "Longest wait before one retry, whatever backoff_s or the server's Retry-After says (a wait over 5 s "
        "is logged)",
        at_least=0,
    )
    pass_urls: bool = job_key(
        False,
        "Send image cells that are http(s) URLs to the server as they are, for it to fetch (batchvl neither "
        "downloads nor checks them; the server's refusals are server_rejected rows)",
    )
    api_key_env: str | None = job_key(
        None, "Name of the environment variable holding the API key (never the key itself)"
    )
    startup_timeout_s: float = job_key(900.0, "Longest a launched server may take to answer", above=0)


@dataclass(frozen=True)
class EngineConfig:
    max_num_seqs: int | Literal["auto"] = job_key(
        "auto",
        "Most requests running at once; auto: 256, and 1024 on a GPU of 70 GiB or more (as vLLM's offline "
        "default there: a decode step reads the weights once for more sequences)",
        above=0,
    )
    max_num_batched_tokens: int | Literal["auto"] = job_key(
        "auto",
        "Token budget of one engine step (decode tokens + prefill chunks); auto: 2048 on CPU, on CUDA the "
        "largest of 16384, 8192, 4096 whose measured activations take at most a tenth of the free memory",
        above=0,
    )
    kv_cache_mb: float | Literal["auto"] = job_key(
        "auto",
        "Memory for the paged KV cache, in MiB; auto: 1024 on CPU, on CUDA a share (gpu_memory_utilization) "
        "of the GPU memory free after the model, less the largest step's measured activations and a reserve "
        "for a vision call and the encoder cache",
        above=0,
    )
    gpu_memory_utilization: float = job_key(
        0.9,
        "kv_cache_mb auto on CUDA: the share of the memory left after the model and the reserve that the "
        "KV cache takes (as vLLM's option of that name, a bound that leaves room for other processes)",
        above=0,
        at_most=1,
    )
    block_size: int = job_key(16, "Tokens per KV-cache block", above=0)
    encoder_cache_mb: float = job_key(
        512, "Memory for cached image embeddings, in MiB (0: keep only while in use)", at_least=0
    )
    encoder_cache_dir: str | None = job_key(
        None,
        "A local folder where image embeddings are kept across runs and jobs (a node-local disk; shared "
        "safely by concurrent runs), keyed by the image's pixels and the vision weights; a new or empty "
        "folder, or an earlier cache's, never one holding other files",
    )
    encoder_cache_dir_gb: float = job_key(
        20.0, "Largest size of encoder_cache_dir, in GiB; the least recently used entries go first", above=0
    )
    max_patches_per_encode: int | Literal["auto"] = job_key(
        "auto",
        "Most image patches in one vision-tower call (images are grouped by patch count); auto: 4096 on CPU, "
        "on CUDA the largest of 32768, 16384, 8192 whose bound of 128 KiB a patch is at most a tenth of the "
        "free memory",
        above=0,
    )
    prefix_caching: bool = job_key(
        True, "Reuse the KV cache of shared prompt prefixes (system prompt + image) across requests"
    )
    lookahead: int = job_key(
        64,
        "Requests waiting in the engine, admitted cheapest image first (1: strict arrival order); the run "
        "holds as many prepared samples ready for it",
        above=0,
    )
    disable_chunked_mm_input: bool = job_key(
        False, "Never split an image's placeholder tokens across prefill chunks"
    )
    overlap: bool | Literal["auto"] = job_key(
        "auto",
        "Launch each engine step before reading the previous step's picks, greedy or sampled, which stay on "
        "the device (the host's work for a step runs while the GPU computes the one before, constrained "
        "rows' masks and log-probabilities included). auto: on CUDA, off on the CPU",
    )
    vit_parallel: Literal["none", "data"] = job_key(
        "none", "'data': split each encode step's images across torchrun ranks (ViT data parallelism)"
    )
    threads: int = job_key(0, "torch intra-op threads (0: torch's default)", at_least=0, at_most=MOST_CORES)
    cuda_graphs: bool | Literal["auto"] = job_key(
        "auto",
        "On CUDA, replay steps of decodes only as CUDA graphs (the largest row bucket's captured as the "
        "engine starts, a smaller bucket's step padded into it until steps have needed that bucket often): "
        "far fewer kernel launches a step; ignored off CUDA. auto: on (CUDA)",
    )
    vision_graphs: bool | Literal["auto"] = job_key(
        "auto",
        "On CUDA, replay the Qwen-VL towers' vision calls as CUDA graphs, their rows, images (and "
        "windows) and longest image rounded up to a few shapes (each captured the second time a call "
        "needs it): one launch a call, not some 400; ignored off CUDA, for the towers over equal crops "
        "(LLaVA, Idefics3, SmolVLM2, InternVL) and under vision_attention: sdpa. auto: off until measured "
        "on a GPU",
    )
    vision_attention: Literal["auto", "flash_varlen", "sdpa"] = job_key(
        "auto",
        "The Qwen-VL vision towers' attention on CUDA: flash_varlen, every image of a vision call in one "
        "FlashAttention-2 varlen call per layer; sdpa, the images of each size batched through torch's SDPA, "
        "cuDNN's kernel first. auto: flash_varlen",
    )
    fused_kernels: bool | Literal["auto"] = job_key(
        "auto",
        "On CUDA, RMSNorm, LayerNorm, SiLU*mul, QuickGELU and rotary as one Triton kernel each instead of "
        "several eager ones; ignored off CUDA. auto: on (CUDA)",
    )
    replicas: int | Literal["auto"] = job_key(
        "auto",
        "On the CPU, engines over the one loaded model, each stepping in a thread of its own with an equal "
        "share of the threads and of kv_cache_mb and encoder_cache_mb, an engine waiting for requests "
        "lending its threads to those with work (auto: one per core, at most 8; 1 for a run of fewer than "
        "32 requests or a model of more than 1 GiB of weights, on CUDA and under ViT data parallelism)",
        above=0,
    )
    backend: Literal["batchvl", "openai"] = job_key(
        "batchvl",
        "batchvl: the built-in engine, in this process; openai: an OpenAI-compatible server (vLLM, SGLang), "
        "set under engine.server",
        defines_output=True,
        unset_leaves_fingerprint=True,
    )
    server: ServerConfig = job_key(help="The server of the openai backend", factory=ServerConfig)


@dataclass(frozen=True)
class PreprocessConfig:
    min_pixels: int | None = job_key(
        None, "Smallest resized pixel count (null: the model processor's own)", above=0, defines_output=True
    )
    max_pixels: int | None = job_key(
        None, "Largest resized pixel count (null: the model processor's own)", above=0, defines_output=True
    )
    max_image_pixels: int = job_key(
        50_000_000,
        "Images over this many pixels are refused before full decode",
        above=0,
        defines_output=True,
    )
    video_fps: float = job_key(
        2.0, "Frames sampled per second of video (Qwen-VL, InternVL)", above=0, defines_output=True
    )
    video_min_frames: int = job_key(
        4, "Fewest frames sampled from a video (Qwen-VL, InternVL)", above=0, defines_output=True
    )
    video_max_frames: int = job_key(
        64, "Most frames sampled from a video (Qwen-VL, InternVL)", above=0, defines_output=True
    )
    video_max_pixels: int = job_key(
        20_000_000,
        "Pixel budget of one video over all its frames (each frame gets an even share; Qwen-VL)",
        above=0,
        defines_output=True,
    )
    workers: int | None = job_key(
        None,
        "Preprocessing worker processes (0: in the main process; null: half the CPU cores the run may use, "
        "a Slurm task's or a container's, 1 to 8; more than those cores is warned of)",
        at_least=0,
        at_most=MOST_CORES,
    )
    prefetch: int = job_key(8, "Prepared samples each worker may hold ready ahead of the engine", above=0)
    timeout_s: float = job_key(
        120.0,
        "A sample whose preprocessing (its downloads included) takes longer becomes an error row and its "
        "worker is replaced (needs workers >= 1)",
        above=0,
    )


@dataclass(frozen=True)
class OutputConfig:
    dir: str = job_key(
        help="Output folder: one Parquet file per input shard, stats in _batchvl/; a local path or an "
        "object-store URL (s3://bucket/prefix, gs://...)"
    )
    format: Literal["parquet", "openai_batch"] = job_key(
        "parquet",
        "openai_batch: also a JSONL file per shard in the batch API's output shape, beside its Parquet file",
        defines_output=True,
        unset_leaves_fingerprint=True,
    )
    storage_options: dict = job_key(
        help="fsspec options for an `s3://`, `gs://` ... output.dir (credentials, endpoint_url); empty: the "
        "environment's, as fsspec finds them",
        factory=dict,
    )
    overwrite: bool = job_key(
        False, "Recompute shards that are already written, even when they were written with another config"
    )
    max_error_rate: float | None = job_key(
        None,
        "Largest share of error rows in the job's committed shards (its task's, under --shard or an array), "
        "earlier runs' included (0.05 = 5%); over it the run exits with code 3 after committing its shards, "
        "and so does a rerun until the errors are retried (null: no limit)",
        at_least=0,
        at_most=1,
    )


def _default_prompts() -> list[PromptConfig]:
    return [PromptConfig(name="caption", text="Describe this image.")]


# openai_batch requests carry their own messages: the job has this one prompt, whose text is unused.
CHAT_PROMPT = PromptConfig(name="response", text="")


@dataclass(frozen=True)
class JobConfig:
    model: ModelConfig = job_key(help="The model")
    input: InputConfig = job_key(help="The input dataset")
    output: OutputConfig = job_key(help="Where results go")
    prompts: list[PromptConfig] = job_key(
        help="One request per (sample, prompt)", factory=_default_prompts, defines_output=True
    )
    sampling: SamplingConfig = job_key(help="Decoding", factory=SamplingConfig, defines_output=True)
    engine: EngineConfig = job_key(help="Engine limits", factory=EngineConfig)
    preprocess: PreprocessConfig = job_key(help="Image and video preprocessing", factory=PreprocessConfig)

    def __post_init__(self) -> None:
        # A config built in Python (the API, a notebook) is held to the rules a job file is: every key's
        # type and bounds, then what relates keys to each other.
        _check_keys(self, "")
        _check_values(self)

    @functools.cached_property
    def prompt_samplings(self) -> tuple[SamplingConfig, ...]:
        """Each prompt's sampling, in prompt order: the `sampling` section with the prompt's own keys in
        place of its values. Read once per config, not per request (a frozen dataclass keeps it)."""
        return tuple(
            prompt_sampling(self.sampling, prompt, f"prompts[{index}].sampling")
            for index, prompt in enumerate(self.prompts)
        )


def prompt_sampling(job: SamplingConfig, prompt: PromptConfig, key: str) -> SamplingConfig:
    """A prompt's sampling: `job` with the keys the prompt gives in place of their values, each read and
    checked as a key of the section is (an unknown key, a wrong type, a value out of bounds is a one-line
    `ConfigError` naming `key`)."""
    if prompt.sampling is None:
        return job
    own = build(SamplingConfig, prompt.sampling, key)
    _check_keys(own, f"{key}.")
    fields = {file_key(f): f.name for f in dataclasses.fields(SamplingConfig)}
    return dataclasses.replace(job, **{fields[k]: getattr(own, fields[k]) for k in prompt.sampling})


def _check_keys(section: Any, prefix: str) -> None:
    """Every key's type and bounds, section by section: what the loader's conversion checks in a job file,
    for a config built from dataclasses, which skips it."""
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        key, value, tp = f"{prefix}{file_key(f)}", getattr(section, f.name), hints[f.name]
        inner = [a for a in (tp, *typing.get_args(tp)) if dataclasses.is_dataclass(a)]
        if inner and typing.get_origin(tp) is list:  # prompts
            if not isinstance(value, list):
                raise ConfigError(f"'{key}' must be a list, got {value!r} ({type(value).__name__})")
            for i, item in enumerate(value):
                _check_section(item, inner[0], f"{key}[{i}]")
        elif inner:
            if value is not None or type(None) not in typing.get_args(tp):
                _check_section(value, inner[0], key)
        else:
            convert(value, tp, key)
            check_bounds(key, value, f.metadata)


def _check_section(value: Any, cls: type, key: str) -> None:
    if not isinstance(value, cls):
        raise ConfigError(f"'{key}' must be a {cls.__name__}, got {type(value).__name__}")
    _check_keys(value, f"{key}.")


def check_model_keys(model: ModelConfig) -> None:
    """The model section's keys, as a job checks them (`load_model` in Python takes them one by one)."""
    _check_section(model, ModelConfig, "model")
    _check_device(model.device)


def _check_device(device: str) -> None:
    if not re.fullmatch(r"cpu|auto|cuda(:\d+)?", device):
        raise ConfigError(f"'model.device' must be cpu, cuda, cuda:N or auto; got {device!r}")


def _check_values(cfg: JobConfig) -> None:
    """What one key's bounds cannot say (each key's own bounds are checked as it is read)."""
    _check_device(cfg.model.device)  # the section's keys are checked with every other section's
    p = cfg.preprocess
    if p.min_pixels is not None and p.max_pixels is not None and p.min_pixels > p.max_pixels:
        raise ConfigError("'preprocess.min_pixels' must not exceed 'preprocess.max_pixels'")
    # a min_pixels of 1e12 enlarged each image to terabytes
    if p.min_pixels is not None and p.min_pixels > p.max_image_pixels:
        raise ConfigError(
            f"'preprocess.min_pixels' ({p.min_pixels}) must not exceed 'preprocess.max_image_pixels' "
            f"({p.max_image_pixels}): each image would be enlarged past the largest one the job reads"
        )
    if p.video_min_frames > p.video_max_frames:
        raise ConfigError(
            f"'preprocess.video_min_frames' ({p.video_min_frames}) must not exceed "
            f"'preprocess.video_max_frames' ({p.video_max_frames})"
        )
    if not cfg.output.dir.strip():
        raise ConfigError("'output.dir' is empty; name the folder the results go to")
    if any(not path.strip() for path in cfg.input.paths):
        raise ConfigError(f"'input.paths' holds an empty path: {cfg.input.paths}; remove it")
    if not cfg.input.paths:
        raise ConfigError("'input.paths' must list at least one path or glob")
    remote = [p for p in cfg.input.paths if is_remote(p)]
    if remote and cfg.input.format in ("folder", "hf_dataset"):
        raise ConfigError(
            f"input.format {cfg.input.format} reads local folders; '{remote[0]}' is a URL (parquet, "
            "webdataset and openai_batch files can be read from object stores)"
        )
    if not cfg.prompts:
        raise ConfigError("'prompts' must hold at least one prompt")
    names = [prompt.name for prompt in cfg.prompts]
    if len(set(names)) != len(names):
        raise ConfigError(f"'prompts' names must be unique, got {names}")
    _check_column_names(names)
    _check_stop_strings(cfg.sampling.stop, "sampling.stop")
    for index, prompt in enumerate(cfg.prompts):
        _check_constraint_keys(prompt)
        own = prompt_sampling(cfg.sampling, prompt, f"prompts[{index}].sampling")  # its own keys' mistakes
        _check_stop_strings(own.stop, f"prompts[{index}].sampling.stop")
    _check_server(cfg.engine)
    _check_encoder_cache_dir(cfg.engine)


def _check_stop_strings(stop: list[str], key: str) -> None:
    """An empty stop string is found before any text: it stopped nothing, where the job meant a stop."""
    if "" in stop:
        raise ConfigError(f"'{key}' holds an empty string, which stops at no text; remove it")


def _check_encoder_cache_dir(engine: EngineConfig) -> None:
    folder = engine.encoder_cache_dir
    if folder is not None and is_remote(folder):
        raise ConfigError(
            f"'engine.encoder_cache_dir' must be a local folder (a node-local disk), got {folder!r}"
        )
    if folder is not None and engine.backend != "batchvl":
        raise ConfigError("'engine.encoder_cache_dir' applies to engine.backend: batchvl; remove it")


def _check_server(engine: EngineConfig) -> None:
    server = engine.server
    if engine.backend != "openai":
        if server != ServerConfig():
            raise ConfigError(
                "'engine.server' applies to engine.backend: openai; set it, or remove engine.server"
            )
        return
    if (server.url is None) == (server.launch is None):
        raise ConfigError(
            "engine.backend openai takes one of 'engine.server.url' (a running server) or "
            "'engine.server.launch' (a command that starts one)"
        )
    if server.url is not None and not server.url.startswith(("http://", "https://")):
        raise ConfigError(f"'engine.server.url' must be an http(s) URL, got {server.url!r}")
    if server.launch_args and server.launch is None:
        raise ConfigError("'engine.server.launch_args' applies to 'engine.server.launch'; remove it")
    if server.api_key_env is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", server.api_key_env):
        # not echoed: a value that is no variable's name may be the key itself
        raise ConfigError(
            "'engine.server.api_key_env' must be the name of the environment variable holding the API key "
            "(letters, digits and _, e.g. OPENAI_API_KEY), not the key itself; or remove it"
        )


LABEL_COLUMNS = ("shard", "key", "sample_index")  # the label table's own columns, before the prompts'


PROMPT_COLUMN_SUFFIXES = ("_status", "_probs")  # a prompt's columns in the label table besides its value


def _check_column_names(names: list[str]) -> None:
    """A prompt's name names its label-table columns (`<name>`, `<name>_status`, `<name>_probs`): none may
    be empty, or be a column of the table's own or of another prompt."""
    if any(not name.strip() for name in names):
        raise ConfigError(f"'prompts' names must not be empty, got {names}; name each prompt")
    reserved = f"{', '.join(LABEL_COLUMNS)} and each prompt's <name>{'/<name>'.join(PROMPT_COLUMN_SUFFIXES)}"
    for name in names:
        owner = next((n for n in names for s in PROMPT_COLUMN_SUFFIXES if n + s == name), None)
        if name in LABEL_COLUMNS or owner is not None:
            column = f"prompt '{owner}''s {name} column" if owner else f"the {name} column"
            raise ConfigError(
                f"prompt name '{name}' would replace {column} in the labels (reserved: {reserved}); "
                "rename the prompt"
            )


def _check_constraint_keys(prompt: PromptConfig) -> None:
    where = f"prompt '{prompt.name}'"
    given = [k for k in ("json_schema", "regex", "choices") if getattr(prompt, k) is not None]
    if len(given) > 1:
        raise ConfigError(f"{where} has {' and '.join(given)}; keep one constraint per prompt")
    if prompt.choices is not None:
        if not prompt.choices or any(choice == "" for choice in prompt.choices):
            raise ConfigError(f"{where}: 'choices' must list at least one non-empty string")
        if len(set(prompt.choices)) != len(prompt.choices):
            raise ConfigError(f"{where}: 'choices' holds a choice twice: {prompt.choices}")
    if prompt.choice_mode != "score" and prompt.choices is None:
        raise ConfigError(f"{where}: 'choice_mode' applies to a choices prompt; remove it")
    if prompt.json_whitespace != "compact" and prompt.json_schema is None:
        raise ConfigError(f"{where}: 'json_whitespace' applies to a json_schema prompt; remove it")
    if prompt.when is not None and (prompt.when.equals is None) == (prompt.when.in_ is None):
        raise ConfigError(f"{where}: 'when' takes one of 'equals' or 'in'")
    if prompt.when is not None and prompt.when.in_ == []:
        raise ConfigError(f"{where}: 'when.in' must list at least one output (with none, it never runs)")


def is_remote(path: str) -> bool:
    """A URL with a protocol other than file:// (s3://bucket/...): read through fsspec."""
    return "://" in path and not path.startswith("file://")
