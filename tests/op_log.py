"""DeviceOpLog: the torch ops a block of code runs, with the device types of their tensor arguments.

On the ``meta`` device (the CUDA code path without data: any host read of a device value raises) it
counts the device ops a step would launch and its host->device copies.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

VIEW_OPS = {"slice", "alias", "detach", "unsqueeze", "expand", "view", "select", "as_strided", "squeeze",
            "t", "reshape", "_reshape_alias"}


class DeviceOpLog(TorchDispatchMode):
    """Records every torch op with the device types of its tensor arguments (``device`` = meta here)."""

    def __init__(self, device: str = "meta"):
        super().__init__()
        self.device, self.ops = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        self.ops.append((func.overloadpacket.__name__, [a.device.type for a in flat if isinstance(a, torch.Tensor)]))
        return func(*args, **kwargs)

    def device_ops(self) -> Counter:
        """Ops (views excluded) touching a device tensor: the kernel launches on a GPU."""
        return Counter(name for name, devs in self.ops if self.device in devs and name not in VIEW_OPS)

    def host_to_device_copies(self) -> int:
        return sum(name == "copy_" and devs == [self.device, "cpu"] for name, devs in self.ops)
