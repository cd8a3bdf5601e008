"""The job loop's heap policy: activations of many MiB reuse freed memory instead of new pages."""

import subprocess
import sys

import pytest

from batchvl.utils.memory import load_libc

VISION_MLP_STEPS = """
import resource, sys
import torch
from batchvl.utils.memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
torch.manual_seed(0)
w1, w2 = torch.randn(64, 2048) * 0.02, torch.randn(2048, 64) * 0.02
def layer(x):  # a vision-tower MLP's activations (8 to 16 MiB, made and dropped), with a narrow input and
    # output so that the matmuls cost little
    h = x @ w1
    h = h * torch.sigmoid(1.702 * h)
    return x + h @ w2
def encode_calls():  # of varying patch counts, three layers each; 24 calls, so that the default heap
    # faults far more than the noise floor of a kept heap (up to about 4,000 faults here) in every run
    for step in range(24):
        x = torch.randn((2000, 1500, 1800)[step % 3], 64)
        for _ in range(3):
            x = layer(x)
encode_calls()  # warm-up: the heap grows to what the calls need
faults = []
for _ in range(3):  # the median of three rounds: one round's count can be far off
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    encode_calls()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults)[1])
"""
# The pages the activations of one round occupy, were none of them reused: per layer, four (rows, 2048)
# and two (rows, 64) float32 tensors, for 24 calls of 2000, 1500 and 1800 rows, three layers each.
ACTIVATION_PAGES = 8 * (2000 + 1500 + 1800) * 3 * (4 * 2048 + 2 * 64) * 4 // 4096


def page_faults(mode: str) -> int:
    result = subprocess.run(
        [sys.executable, "-c", VISION_MLP_STEPS, mode], capture_output=True, text=True, check=True
    )
    return int(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(
    load_libc() is None or not hasattr(load_libc(), "mallopt"), reason="glibc's mallopt is not available"
)
def test_freed_activations_are_reused_instead_of_faulted_in_again():
    default, kept = page_faults("default"), page_faults("keep")
    # Kept, a round runs in the memory the round before freed: under 1% of its activations' pages are
    # faulted in (a few thousand at most have been seen). Default glibc maps many activations afresh and
    # touches them page by page: tens to hundreds of thousands of faults, varying a lot between runs, so
    # that side only has to show the workload would fault without the policy.
    assert kept < ACTIVATION_PAGES / 100, (kept, ACTIVATION_PAGES)
    assert default > 20_000, default
