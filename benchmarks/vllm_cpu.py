"""Where the throughput benchmark finds vLLM's CPU build, and how its vLLM methods set it up. It runs in a
virtualenv of its own (`vllm_env.sh`: vLLM pins its own transformers), which methods d and e (`vllm_peer.py`)
and the server of f and g run from."""

from __future__ import annotations

import os
from pathlib import Path

VLLM_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache" / "batchvl" / "vllm-venv"))
# Methods d and e: vLLM's defaults keep one of the machine's cores for its scheduler process, its "all
# cores" setting binds the model's threads to every core.
VLLM_SETTINGS = {
    "d": {},
    "e": {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}"},
}
