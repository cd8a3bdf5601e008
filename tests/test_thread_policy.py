"""Importing batchvl bounds how long OpenMP threads spin between ops, before torch loads its OpenMP runtime
(spinning threads beside another CPU-bound process slowed a job 9x on 2 cores; never spinning cost 25%
on a quiet CPU), and a user's own setting wins."""

import os
import subprocess
import sys

PROBE = (
    "import os, sys, batchvl; "
    "print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'), 'torch' in sys.modules)"
)
OPENMP_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def probe(**settings: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_SETTINGS} | settings
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    return out.stdout.strip()


def test_import_bounds_the_spin_before_torch_is_loaded():
    assert probe() == "None 5000 False"


def test_a_users_own_wait_policy_wins():
    assert probe(OMP_WAIT_POLICY="PASSIVE") == "PASSIVE None False"  # a spin count would override it


def test_a_users_own_spin_count_wins():
    assert probe(GOMP_SPINCOUNT="100") == "None 100 False"
