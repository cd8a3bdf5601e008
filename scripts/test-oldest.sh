#!/usr/bin/env bash
# The oldest supported transformers (batchvl/utils/versions.py) without a second environment: it, and what it needs
# that differs from the newest (huggingface_hub < 2), go with --no-deps into a folder put first on PYTHONPATH.
# There: the engine, family and video parity tests and the Triton kernels' compilation, then one `batchvl run`
# whose rows must equal the newest's.
# Usage: [NEWEST=PYTHON] scripts/test-oldest.sh PYTHON FOLDER PACKAGE==VERSION...
# PYTHON's environment gives torch; NEWEST (by default PYTHON itself) is the interpreter of the environment
# whose run is the reference: another environment's, with the newest torch, where PYTHON's has the oldest
# (make test-oldest-torch).
set -euo pipefail
py=$1 site=$(realpath -m "$2") newest=${NEWEST:-$1}
shift 2
"$py" -m pip install -q --no-deps --upgrade --target "$site" "$@"
export HF_HUB_OFFLINE=1
oldest() { PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" "$@"; }

# The releases imported are the pinned ones, from the folder, beside the environment's torch.
oldest "$py" - "$site" "$@" <<'PY'
import importlib, sys
site, pins = sys.argv[1], dict(arg.split("==") for arg in sys.argv[2:])
for name, pinned in pins.items():
    module = importlib.import_module(name.replace("-", "_"))
    assert module.__version__ == pinned and module.__file__.startswith(site), (name, module.__version__, module.__file__)
import torch
print("oldest end:", ", ".join(f"{name} {pinned}" for name, pinned in pins.items()), f"(torch {torch.__version__})")
PY

# The parity tests, the engine's own loop of layers and a job that reads nothing back from the device; and the
# Triton attention kernels compiled for a Hopper GPU (none needed) by the environment's Triton, which is torch's:
# torch 2.6 brings Triton 3.2.
oldest "$py" -m pytest -q -p no:cacheprovider tests/engine/test_parity.py tests/engine/test_family_parity.py \
    tests/engine/test_video_parity.py tests/engine/test_tiled_video_parity.py tests/preprocess/test_smolvlm_video.py \
    tests/preprocess/test_internvl_video.py tests/preprocess/test_internvl_tiles.py tests/models/test_published_layouts.py \
    tests/layers/test_decoder_stack.py tests/engine/test_device_reads.py \
    "tests/layers/test_triton_attention.py::test_the_kernels_compile_for_a_hopper_gpu" \
    "tests/layers/test_triton_grouped_decode.py::test_the_kernels_compile_for_a_hopper_gpu"

# One job end to end, run by the newest and the oldest: the same rows, the greedy texts included.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$newest" -m batchvl make-tiny-model "$work/model" --size tiny
"$newest" -m batchvl make-sample-data "$work/data" --num-shards 2
cat > "$work/job.yaml" <<'YAML'
model: {path: model, dtype: float32, device: cpu}
input: {paths: ["data/*.parquet"], key_column: key}
prompts:
  - {name: caption, text: Describe this image.}
  - {name: kind, text: "Photo or drawing?", choices: [photo, drawing]}
sampling: {max_new_tokens: 16}
engine: {max_num_seqs: 8, max_num_batched_tokens: 256, kv_cache_mb: 64}
output: {dir: out}
YAML
"$newest" -c 'import torch, transformers; print(f"newest end: transformers {transformers.__version__} (torch {torch.__version__})")'
"$newest" -m batchvl run "$work/job.yaml" --no-progress --set output.dir="$work/newest"
oldest "$py" -m batchvl run "$work/job.yaml" --no-progress --set output.dir="$work/oldest"
"$py" - "$work" <<'PY'
import sys
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
columns = ["key", "prompt", "status", "text", "error_type", "num_prompt_tokens", "num_output_tokens"]
def rows(end):  # every shard's rows (the output folder also holds batchvl's own files)
    shards = sorted(Path(sys.argv[1], end).glob("*.parquet"))
    return pa.concat_tables(pq.read_table(shard, columns=columns) for shard in shards).to_pylist()
newest, oldest = rows("newest"), rows("oldest")
assert len(newest) > 0 and newest == oldest, "the oldest releases wrote other rows than the newest"
ok = sum(row["status"] == "ok" for row in newest)
assert ok, "no row ok"
print(f"batchvl run: the same {len(newest)} rows on both ends ({ok} ok)")
PY
