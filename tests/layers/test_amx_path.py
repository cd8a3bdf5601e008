"""On a CPU with AMX tiles the bf16 engine takes the tiles' path: prefill chunks and the vision tower go to
torch's fused attention, which runs its bf16 products on the tiles, where a CPU without them runs batchvl's
own AVX-512 kernels (decodes take the native decode kernel on both). Its outputs stay as close to float32 as
transformers' own bf16 model (float32 is the parity tests' business, on every CPU). Elsewhere these tests
skip with one reason, which CI accepts (tests/ci_policy.py): only such a CPU can run them."""

import pytest
import torch

from batchvl.layers import cpu_attention
from batchvl.layers.cpu_features import has_amx
from batchvl.layers.native_kernels import native_ops
from tests.ci_policy import NEEDS_AMX
from tests.engine.test_bf16_accuracy import assert_as_close_as_transformers_bf16, bf16_engine_logits

pytestmark = pytest.mark.skipif(not has_amx(), reason=NEEDS_AMX)


def test_the_bf16_engine_attends_on_the_tiles_and_stays_as_accurate(tiny_model_dir, monkeypatch):
    bf16_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(query, *args, **kwargs):
        bf16_calls.append(query.dtype == torch.bfloat16)
        return sdpa(query, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    native = native_ops()
    if native is not None:  # none of batchvl's own bf16 attention kernels may run
        for kernel in ("varlen_attention", "paged_prefill_attention"):
            monkeypatch.setattr(native, kernel, lambda *args, name=kernel: pytest.fail(f"{name} ran"))
    assert not cpu_attention.use_native_attention(torch.zeros(1, 64, dtype=torch.bfloat16))
    logits = bf16_engine_logits(tiny_model_dir)
    assert bf16_calls and all(bf16_calls)  # prefills and the vision tower: torch's kernel, in bf16
    assert_as_close_as_transformers_bf16(tiny_model_dir, logits)
