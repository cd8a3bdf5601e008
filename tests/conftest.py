import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
from PIL import Image

pytest_plugins = ["pytester", "tests.ci_policy"]

# Test models attend sharply (queries and keys scaled by this): with the random weights' near-uniform
# attention, wrong positions or masks barely move the logits and could pass the parity tests.
SHARPNESS = 8.0

# Where the engine under test runs: BATCHVL_TEST_DEVICE=cuda runs the parity, sampler, constrained-decoding,
# family and ViT-DP tests on a GPU against references computed on the CPU (`make gpu-check`).
TEST_DEVICE = os.environ.get("BATCHVL_TEST_DEVICE", "cpu")
# BATCHVL_TEST_FAST_PATHS=1 runs the engine and family parity tests with every fast path on: decode graphs
# (CUDA's on a GPU, tests/engine/fake_graphs.py's on the CPU), overlapped steps, and the fused kernels
# (`engine.fused_kernels`, CUDA only) in the test models (`make gpu-check`'s fast_paths_parity stage).
TEST_FAST_PATHS = os.environ.get("BATCHVL_TEST_FAST_PATHS") == "1"
if TEST_DEVICE.startswith("cuda"):
    import torch

    # fp32 means fp32 on both sides of a cross-device comparison: cuDNN's convolutions (the patch
    # embedding) would otherwise round through TF32
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def reference_processor(path):
    """The model's own processor as the references use it: transformers' Pillow backend, which batchvl's
    preprocessing reproduces. Where torchvision is installed, transformers defaults to its torchvision
    backend, whose pixels differ by a rounding step here and there: references computed from those differ
    from the engine's by the input, not by the engine."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path, backend="pil")


def bf16_packs() -> bool:
    """Whether oneDNN has bf16 kernels on this CPU, asked of torch itself rather than of the code under
    test. On one without AVX-512 (an AVX2-only machine) torch cannot pack bf16 weights, and a bf16 model's
    linear layers stay plain: the packing tests check that there instead."""
    import torch

    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.fixture(autouse=True, scope="session")
def cpu_sized_kv_cache():
    """On a GPU, `engine.kv_cache_mb: auto` fills it (about 8 million blocks of the tiny model on an H100,
    which `check_integrity` walks after every step: 25 s a parity test). The tests keep the CPU's cache
    there, so that they also preempt where they do on the CPU."""
    if TEST_DEVICE == "cpu":
        yield
        return
    import torch

    import batchvl.engine.engine as engine_module

    sized_for = engine_module.kv_cache_bytes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            engine_module,
            "kv_cache_bytes",
            lambda config, _device, _peak: sized_for(config, torch.device("cpu"), _peak),
        )
        yield


@pytest.fixture(scope="session")
def s3():
    """An S3-compatible server (moto's) on 127.0.0.1 with a bucket `data`: (endpoint URL, boto3 client)."""
    import boto3
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    keys = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing"}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", **keys)
    client.create_bucket(Bucket="data")
    yield endpoint, client
    server.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from batchvl.demo.tiny_model import build_tiny_model

    folder = tmp_path_factory.mktemp("models") / "tiny-qwen2-vl"
    return build_tiny_model(folder, size="tiny", seed=0, sharpness=SHARPNESS)


@pytest.fixture(scope="session")
def loaded_fp32(tiny_model_dir):
    from batchvl.models.loader import load_model

    return load_model(str(tiny_model_dir), dtype="float32", device=TEST_DEVICE, fused_kernels=TEST_FAST_PATHS)


NEW_FAMILIES = [
    "qwen2_5_vl",
    "qwen3_vl",
    "llava",
    "idefics3",
    "smolvlm",
    "internvl",
]  # qwen2_vl is the `tiny_model_dir` of the other tests


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """family -> (model folder, model loaded in fp32), built on first use."""
    from batchvl.demo.tiny_model import build_tiny_model
    from batchvl.models.loader import load_model

    built = {}

    def get(family: str):
        if family not in built:
            folder = tmp_path_factory.mktemp("models") / family
            path = build_tiny_model(folder, family=family, seed=0, sharpness=SHARPNESS)
            loaded = load_model(str(path), dtype="float32", device=TEST_DEVICE, fused_kernels=TEST_FAST_PATHS)
            built[family] = (path, loaded)
        return built[family]

    return get


def processor_and_preparer(family_models, family: str):
    """(processor, media preparer at the default preprocessing settings) of a family's tiny model."""
    from batchvl.config import PreprocessConfig

    _, loaded = family_models(family)
    config = loaded.adapter.model.config
    return loaded.processor, loaded.family.media_preparer(loaded.processor, config, PreprocessConfig())


def tower_pixels(media) -> np.ndarray:
    """The float32 tower input of prepared media (one item, or a vision call's list), made as a vision call
    stages it (normalized where it has a normalization), on the CPU."""
    import torch

    from batchvl.engine.device.pixel_staging import stage_pixels

    items = media if isinstance(media, list) else [media]
    rows = sum(len(item.pixel_values) for item in items)
    return stage_pixels(items, rows, torch.float32, torch.device("cpu")).numpy()


def png_bytes(image: Image.Image) -> bytes:
    import io

    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def output_rows(out_dir, num_shards: int) -> list[dict]:
    """Every row of output shards part-0 .. part-{num_shards-1}, in order, without the timing column."""
    import pyarrow.parquet as pq

    from batchvl.outputs.writers import output_name

    return [
        row
        for number in range(num_shards)
        for row in pq.read_table(Path(out_dir, output_name(f"part-{number}.parquet")))
        .drop(["latency_s"])
        .to_pylist()
    ]


def random_image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8))


def write_image_shards(
    folder, sizes: list[int], replaced: dict[tuple[int, int], bytes] | None = None
) -> None:
    """Parquet shards `folder/part-N.parquet` of sizes[N] random PNGs keyed `sN-i`; `replaced` puts other
    bytes at (N, i) (a broken or an oversize image)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for number, size in enumerate(sizes):
        images = [
            (replaced or {}).get((number, i))
            or png_bytes(random_image(40 + 9 * i, 60 + 7 * number, seed=10 * number + i))
            for i in range(size)
        ]
        keys = [f"s{number}-{i}" for i in range(size)]
        pq.write_table(pa.table({"key": keys, "image": images}), folder / f"part-{number}.parquet")


def two_prompt_job_yaml(model_dir, engine: str, extra: str = "") -> str:
    """A job file over `data/*.parquet` (key column `key`) with two prompts, written to `out`."""
    return f"""
model: {{path: {model_dir}, dtype: float32, device: {TEST_DEVICE}}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts:
  - {{name: caption, text: Describe this image.}}
  - {{name: short, text: One word.}}
sampling: {{max_new_tokens: 6}}
engine: {engine}
{extra}
output: {{dir: out}}
"""


def caption_job_yaml(model_dir) -> str:
    """A job file over `data/*.parquet` (key column `key`) with one caption prompt, in-process preprocessing,
    written to `out`."""
    return f"""
model: {{path: {model_dir}, dtype: float32, device: cpu}}
input: {{paths: ["data/*.parquet"], key_column: key}}
prompts: [{{name: caption, text: Describe this image.}}]
sampling: {{max_new_tokens: 4}}
preprocess: {{workers: 0}}
output: {{dir: out}}
"""


def video_bytes(num_frames: int, fps: int, height: int = 64, width: int = 96, seed: int = 0) -> bytes:
    """An mp4 clip whose frame i has mean brightness about 8 * i (so decoded frames can be identified)."""
    import io

    import av

    rng = np.random.default_rng(seed)
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        stream.options = {"qscale": "2"}
        for i in range(num_frames):
            pixels = np.clip(8 * i + rng.integers(-4, 5, size=(height, width, 3)), 0, 255).astype(np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")))
        container.mux(stream.encode())
    return buffer.getvalue()


def cli(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """`batchvl ARGS` in this process: (exit code, stdout, stderr). Seconds faster than a subprocess, which
    imports torch and transformers again."""
    from batchvl.cli import main

    monkeypatch.setattr(sys, "argv", ["batchvl", *map(str, args)])
    try:
        main()
        code = 0
    except SystemExit as ended:
        code = ended.code or 0
    captured = capsys.readouterr()
    return code, captured.out, captured.err
