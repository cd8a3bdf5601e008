"""The parity tests' allowance on another device: twice how far transformers' own `generate` there lands
from the CPU reference, over the positions both reached with the same tokens."""

import torch

import tests.engine.reference as reference
from tests.engine.reference import Expected, device_gap, logits_tolerance


def test_the_gap_runs_to_the_first_differing_token_and_skips_masked_logits():
    on_cpu = Expected([1, 2, 3], torch.zeros(3, 4))
    logits = torch.tensor([[0.1, 0, 0, 0], [0, 0.2, 0, 0], [5.0, 0, 0, 0]])
    logits[0, 3] = float("-inf")  # a grammar's mask: not a difference
    on_device = Expected([1, 5, 6], logits)
    # position 1 chose another token but was computed from the same prefix; position 2 was not
    assert device_gap(on_cpu, on_device) == torch.tensor(0.2).item()
    assert device_gap(on_cpu, Expected([1, 2, 3], torch.zeros(3, 4))) == 0.0


def test_on_another_device_the_allowance_is_twice_transformers_own_gap(monkeypatch):
    model = torch.nn.Linear(2, 2)
    expected = Expected([7, 8], torch.tensor([[10.0, -2.0], [3.0, float("-inf")]]))
    gap = 0.05

    def reference_generate(on_device_model, inputs):
        assert on_device_model is not model  # a copy on the device, the CPU reference kept
        return Expected([7, 8], expected.logits + gap)

    inputs = {"ids": torch.tensor([1, 2])}
    base = reference.LOGITS_TOLERANCE * 10.0  # of the largest finite logit
    assert logits_tolerance(model, inputs, expected, reference_generate) == base  # the CPU: no rerun
    monkeypatch.setattr(reference, "TEST_DEVICE", "cpu:0")  # stands for a GPU: a device of its own
    assert abs(logits_tolerance(model, inputs, expected, reference_generate) - 2 * gap) < 1e-6
