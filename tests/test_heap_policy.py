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
w1, w2 = torch.randn(512, 2048) * 0.02, torch.randn(2048, 512) * 0.02
def layer(x):  # a vision-tower MLP: activations of 8 to 16 MiB made and dropped
    h = x @ w1
    h = h * torch.sigmoid(1.702 * h)
    return x + h @ w2
def encode_calls():  # of varying patch counts, three layers each; 24 calls, so that the default heap
    # faults far more than the noise floor of a kept heap (up to about 4,000 faults here) in every run
    for step in range(24):
        x = torch.randn((2000, 1500, 1800)[step % 3], 512)
        for _ in range(3):
            x = layer(x)
encode_calls()  # warm-up: the heap grows to what the calls need
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
encode_calls()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


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
    # Default glibc maps most activations afresh and touches them page by page: tens of thousands of page
    # faults here. Kept, the second round runs in the memory the first one freed.
    assert default > 20_000 and kept < default / 10, (kept, default)
