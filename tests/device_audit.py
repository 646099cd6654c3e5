"""A device audit that bites on CPU: tensors carry a virtual device label, "role" or "host".

The role is given a device VALUE that differs from torch.device("cpu") — torch.device("cpu", 0)
— while every tensor still lives in CPU memory (torch drops the index of CPU tensors, so the
label is tracked beside them). Inside the audit:

- a tensor the project's own code (hpc_tba/) creates, or moves with `.to`/`.cpu`, is "role"
  when it was asked for on the role's device and "host" otherwise (no device, "cpu", numpy);
- `tensor.device` of a "role" tensor, asked by the project's code, answers the role's device,
  so code that follows `x.device` stays on it, as it would on a GPU;
- an op's result inherits its inputs' label; an op mixing a host tensor (not a 0-dim scalar,
  which CUDA accepts too) with a role tensor is recorded — on a GPU that op would raise;
- checkpoints (`check`) record host tensors reaching the model's forward or a collective.

Tensors made by other libraries (DeepSpeed's buffers, transformers' internals) stay unlabelled.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_PROJECT = os.sep + "hpc_tba" + os.sep
_FACTORIES = {torch.tensor, torch.as_tensor, torch.zeros, torch.ones, torch.full, torch.empty, torch.arange,
              torch.from_numpy, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye}
_MOVES = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda}
_DEVICE_GET = torch.Tensor.device.__get__


def _from_project() -> bool:
    f = sys._getframe(2)
    while f is not None and (os.sep + "torch" + os.sep) in f.f_code.co_filename:
        f = f.f_back
    return f is not None and _PROJECT in f.f_code.co_filename and "device_audit" not in f.f_code.co_filename


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)


class DeviceAudit(TorchFunctionMode):
    def __init__(self, role: torch.device):
        super().__init__()
        self.role = role
        self.violations: list[str] = []

    def label(self, t: torch.Tensor, value: str) -> None:
        t._audit = value

    def _device_arg(self, func, args, kwargs):
        if func is torch.Tensor.cpu:
            return torch.device("cpu")
        if func is torch.Tensor.cuda:
            return None
        if func in _MOVES:
            for a in list(args[1:]) + list(kwargs.values()):
                if isinstance(a, (str, torch.device)):
                    return torch.device(a)
                if isinstance(a, torch.Tensor):
                    return getattr(a, "_audit", None)
            return "inherit"
        if func is torch.from_numpy:
            return torch.device("cpu")
        return torch.device(kwargs["device"]) if kwargs.get("device") is not None else torch.device("cpu")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == _DEVICE_GET:  # a fresh method-wrapper per access: compare by value
            # only to the project's code: torch's own checks (checkpoint metadata) see the truth
            if getattr(args[0], "_audit", None) == "role" and _from_project():
                return self.role
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        label = None
        if (func in _FACTORIES or func in _MOVES) and _from_project():
            dev = self._device_arg(func, args, kwargs)
            if dev == "inherit":
                label = getattr(args[0], "_audit", None)
            elif isinstance(dev, str):
                label = dev
            elif dev is not None:
                label = "role" if dev == self.role else "host"
        elif func not in _FACTORIES:
            labels = {getattr(t, "_audit", None) for t in _tensors((args, kwargs)) if t.dim() > 0}
            scalars_ok = {getattr(t, "_audit", None) for t in _tensors((args, kwargs))}
            if "host" in labels and "role" in labels:
                self.violations.append(f"{getattr(func, '__name__', func)} mixes host and role tensors")
            label = "host" if "host" in labels else "role" if "role" in scalars_ok else None
        if label is not None:
            for t in _tensors(out):
                try:
                    t._audit = label
                except (AttributeError, RuntimeError):
                    pass
        return out

    def check(self, where: str, *values) -> None:
        for t in _tensors(values):
            if getattr(t, "_audit", None) == "host":
                self.violations.append(f"{where} got a {tuple(t.shape)} tensor not on the role's device")
