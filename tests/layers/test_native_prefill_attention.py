"""Prefill chunks attended by the native bf16 kernel straight from the paged cache
(`batchvl/layers/native/bf16_attention.cpp`): each chunk causal over its context and itself, as close to
float64 as torch's attention of the same bf16 step, other rows untouched, and used only where the CPU has
bf16 dot products."""

import pytest
import torch

from batchvl.layers import attention, cpu_attention
from batchvl.layers.attention import (
    KVCache,
    PagedAttentionMetadata,
    SequenceSlice,
    paged_attention,
)
from batchvl.layers.native_kernels import native_ops

HEADS, KV_HEADS, SLOTS = 8, 2, 2000
# (context already cached, this step's chunk): a first chunk, chunks after a context (a prefix-cache hit
# or a later chunk), and one longer than a task's 64 queries; CHUNKS[1], one query, is a decode.
CHUNKS = [(0, 5), (40, 1), (30, 70), (0, 64), (250, 130), (3, 2)]


@pytest.fixture(scope="module")
def ops():
    if native_ops() is None:
        pytest.skip("the native kernels did not build (needs a C++ compiler and ninja)")
    return native_ops()


def step(dim: int, dtype, in_place: bool, seed: int = 0):
    """A step of CHUNKS through `paged_attention`, its context and chunks' keys at scattered slots. Every
    input is a bf16 value, whatever `dtype` computes it."""
    generator = torch.Generator().manual_seed(seed)

    def values(*shape) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 2).bfloat16().to(dtype)

    cache = KVCache.allocate(1, SLOTS, KV_HEADS, dim, dtype, "cpu")
    cache.prefills_in_place = in_place
    cache.decodes_in_place = False
    cache.write(0, torch.arange(SLOTS), *values(2, KV_HEADS, SLOTS, dim))
    order = torch.randperm(SLOTS - 1, generator=generator) + 1
    total = sum(chunk for _, chunk in CHUNKS) + 3  # three padding rows, as a step's row bucket adds
    sequences, step_slots, used, row = [], [], 0, 0
    for cached, chunk in CHUNKS:
        slots = order[used : used + cached + chunk]
        used += cached + chunk
        sequences.append(SequenceSlice(row, chunk, slots))
        step_slots.append(slots[cached:])
        row += chunk
    query = values(1, total, HEADS, dim).transpose(1, 2)  # (1, H, T, D) as transformers hands it over
    key, value = (values(1, total, KV_HEADS, dim).transpose(1, 2) for _ in "kv")
    module = torch.nn.Module()
    module.layer_idx = 0
    meta = PagedAttentionMetadata.build(cache, torch.cat(step_slots), sequences, "cpu")
    out, _ = paged_attention(module, query, key, value, None, batchvl_attention=meta)
    return out[0], meta


def test_as_close_to_float64_as_torchs_attention_of_the_same_bf16_step(ops):
    if not cpu_attention.use_native_attention(torch.zeros(1, 64, dtype=torch.bfloat16)):
        # Not chosen here (no bf16 dot products, or AMX): a bf16 cache keeps torch's attention.
        assert not KVCache.allocate(1, 8, KV_HEADS, 64, torch.bfloat16, "cpu").prefills_in_place
        return
    assert KVCache.allocate(1, 8, KV_HEADS, 64, torch.bfloat16, "cpu").prefills_in_place
    assert not KVCache.allocate(1, 8, KV_HEADS, 64, torch.float32, "cpu").prefills_in_place
    for dim in (32, 64, 80, 128):
        native, meta = step(dim, torch.bfloat16, in_place=True)
        assert meta.in_place_prefills is not None and not meta.sequences
        assert meta.in_place_prefills.counts.tolist() == [chunk for _, chunk in CHUNKS]
        torch_path, meta = step(dim, torch.bfloat16, in_place=False)
        assert meta.in_place_prefills is None
        exact, _ = step(dim, torch.float64, in_place=False)
        real = sum(chunk for _, chunk in CHUNKS)
        native_error = (native[:real].double() - exact[:real]).norm() / exact[:real].norm()
        torch_error = (torch_path[:real].double() - exact[:real]).norm() / exact[:real].norm()
        assert native_error < 0.02
        assert native_error < 2 * torch_error + 1e-3
        assert torch.equal(native[real:], torch.zeros_like(native[real:]))  # the padding rows


def test_each_chunk_attends_causally_to_its_own_keys_only(ops):
    """A chunk's query sees its context and the chunk up to itself: changing a later key of its chunk, or
    another chunk's keys, leaves it as it was."""
    if not cpu_attention.use_native_attention(torch.zeros(1, 64, dtype=torch.bfloat16)):
        return  # the kernel is not chosen on this CPU (checked in the test above)
    generator = torch.Generator().manual_seed(3)
    dim, cached, chunk = 64, 20, 40
    cache = KVCache.allocate(1, 200, KV_HEADS, dim, torch.bfloat16, "cpu")
    cache.write(0, torch.arange(200), *torch.randn(2, KV_HEADS, 200, dim, generator=generator).bfloat16())
    slots = torch.arange(100, 100 + cached + chunk)
    prefills = attention.InPlacePrefills.build([SequenceSlice(0, chunk, slots)], torch.device("cpu"))
    query = torch.randn(HEADS, chunk, dim, generator=generator).bfloat16()

    def attend() -> torch.Tensor:
        out = torch.zeros(chunk, HEADS, dim, dtype=torch.bfloat16)
        prefills.attend(out, query, cache.layers[0], dim**-0.5)
        return out

    before = attend()
    cache.layers[0][:, :, 100 + cached + 30] = 5.0  # the key and value at the chunk's 31st position
    cache.layers[0][:, :, :100] = 9.0  # slots no sequence here reads
    after = attend()
    assert torch.equal(after[:30], before[:30])
    assert not torch.equal(after[30:], before[30:])
