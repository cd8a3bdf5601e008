"""`engine.fused_kernels` on a GPU, where its kernels are compiled (the CPU checks them under Triton's
interpreter: tests/layers/test_fused_kernels.py): a tiny model of each family, loaded on the GPU with the
setting on, has the kernels and equals `generate` on the CPU in float32, within the parity tests' GPU
allowance (twice transformers' own GPU-to-CPU distance). Run where a GPU is:

    BATCHVL_TEST_DEVICE=cuda python -m pytest -q tests/models/fused_kernels_gpu_checks.py
"""

import pytest
import torch
from transformers import AutoModelForImageTextToText

from batchvl.config import EngineConfig
from batchvl.demo.tiny_model import FAMILIES, build_tiny_model
from batchvl.engine.sampling.params import SamplingParams
from batchvl.layers.triton_modules import TritonRMSNorm
from batchvl.models.loader import load_model
from batchvl.preprocess.prompts import PromptRenderer
from tests.conftest import SHARPNESS, TEST_DEVICE, random_image
from tests.engine.reference import assert_matches_reference, make_case, run_cases
from tests.engine.test_family_parity import prepare

if not TEST_DEVICE.startswith("cuda"):
    pytest.skip("needs BATCHVL_TEST_DEVICE=cuda and a GPU", allow_module_level=True)

NEW_TOKENS = 8
IMAGE_SIZES = [(60, 90), (200, 150)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_model_with_the_kernels_on_the_gpu_equals_generate(family, tmp_path):
    path = build_tiny_model(tmp_path / family, family=family, seed=0, sharpness=SHARPNESS)
    loaded = load_model(str(path), dtype="float32", device=TEST_DEVICE, fused_kernels=True)
    assert any(isinstance(module, TritonRMSNorm) for module in loaded.adapter.model.modules())
    reference = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    renderer = PromptRenderer(loaded.processor)
    rendered = renderer.render("Describe this image.", 1)
    cases = []
    for tag, (height, width) in enumerate(IMAGE_SIZES):
        image = random_image(height, width, tag)
        media = prepare(loaded, [image])
        inputs = loaded.processor(text=[rendered], images=[image], return_tensors="pt")
        cases.append(
            make_case(reference, tag, renderer.token_ids(rendered, media), media, inputs, NEW_TOKENS)
        )
    limits = EngineConfig(max_num_batched_tokens=37, block_size=4)
    _, observed = run_cases(loaded, cases, limits, SamplingParams(NEW_TOKENS))
    for case in cases:
        assert_matches_reference(observed[case.tag], case)
