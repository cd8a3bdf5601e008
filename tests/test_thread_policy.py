"""Importing batchvl sets OpenMP's passive wait policy before torch loads its OpenMP runtime (spinning
threads beside another CPU-bound process slowed a job 3x on 2 cores), and a user's own value wins."""

import os
import subprocess
import sys

PROBE = "import os, sys, batchvl; print(os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)"


def probe(env: dict) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip()


def test_import_sets_passive_waiting_before_torch_is_loaded():
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert probe(env) == "PASSIVE False"


def test_a_users_own_wait_policy_wins():
    env = {**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}
    assert probe(env) == "ACTIVE False"
