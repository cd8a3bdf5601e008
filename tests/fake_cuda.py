"""A CPU tensor that behaves as a CUDA tensor where the engine's device logic looks, for tests on machines
without a GPU: it says it is on `cuda:0`, every op on it stays "on the GPU", and copying it to the CPU
gives a plain CPU tensor. Its values are the CPU tensor's, so results can be compared bit for bit with the
CPU path.
"""

from __future__ import annotations

import torch

FAKE_DEVICE = torch.device("cuda", 0)


class FakeCudaTensor(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.is_cuda.__get__:  # a property getter, made anew at each access
            return True
        if func == torch.Tensor.device.__get__:
            return FAKE_DEVICE
        if func in (torch.Tensor.to, torch.Tensor.cpu) and _target_is_cpu(func, args, kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(torch.Tensor)
        return super().__torch_function__(func, types, args, kwargs)


def _target_is_cpu(func, args, kwargs) -> bool:
    if func is torch.Tensor.cpu:
        return True
    device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    return device is not None and device.type == "cpu"


def on_fake_cuda(tensor: torch.Tensor) -> FakeCudaTensor:
    return tensor.clone().as_subclass(FakeCudaTensor)
