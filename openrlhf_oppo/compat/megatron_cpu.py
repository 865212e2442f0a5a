"""Megatron-Core on a machine without CUDA: a shim for the calls megatron-core 0.16.1 makes to
CUDA on the paths the Megatron backend takes (model build, `get_forward_backward_func` with and
without pipeline stages, DDP, the distributed optimizer and its gradient clipping).

`on_cpu()` is a context manager, entered on the thread that runs Megatron (a torch function
mode is per thread). Inside it, where CUDA is absent:
- a tensor factory or `.to()` given a CUDA device (`"cuda"`, `"cuda:N"`, an index, a
  `torch.device`) gets the CPU, and `Tensor.cuda()` returns the tensor itself:
  `pipeline_parallel/schedules.py` (`torch.zeros([], ..., device="cuda")`),
  `distributed/param_and_grad_buffer.py` (the grad buffers on `torch.cuda.current_device()`),
  `models/common/embeddings/rotary_pos_embedding.py` (`get_emb`), `utils.py`
  (`GlobalMemoryBuffer.get_tensor`), `optimizer/clip_grads.py` (`device='cuda'`);
- `Tensor.type()` names a CPU tensor as its CUDA twin (`torch.FloatTensor` ->
  `torch.cuda.FloatTensor`): `optimizer/distrib_optimizer.py` and `optimizer/optimizer.py` sort
  parameters by those names, `optimizer/clip_grads.py` asserts them;
- `torch.cuda.current_device()` answers 0 (then mapped to the CPU as above), and
  `torch.cuda.synchronize()` returns at once (`pipeline_parallel/p2p_communication.py`, after
  each send/receive between stages).

Where CUDA is present the context does nothing. `tests/compat/test_megatron_cpu.py` checks each
named call site in megatron-core's source, so it fails when megatron-core moves one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

MEGATRON_CORE_VERSION = "0.16.1"


def _current_device() -> int:
    return 0  # index 0 is mapped to the CPU


def _synchronize(*args, **kwargs) -> None:
    """Nothing to wait for: CPU work is done when the call returns."""


_CUDA_STUBS = {"current_device": _current_device, "synchronize": _synchronize}
"""torch.cuda functions answered as a one-device CPU would."""

_lock = threading.Lock()
_depth = 0
_saved: dict[str, object] = {}


def _is_cuda(device) -> bool:
    import torch

    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index is a CUDA device to torch
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _mode_class():
    import torch
    from torch.overrides import TorchFunctionMode

    class CudaToCpu(TorchFunctionMode):
        """Maps CUDA devices to the CPU in tensor factories, `.to()` and `.cuda()`."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if func is torch.Tensor.cuda:
                return args[0]
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)
                if ".cuda." in name:
                    return name
                return name.replace("torch.", "torch.cuda.", 1)
            if _is_cuda(kwargs.get("device")):
                kwargs["device"] = "cpu"
            if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
                args = (args[0], "cpu", *args[2:])
            return func(*args, **kwargs)

    return CudaToCpu


def _install_stubs() -> None:
    import torch

    for name, stub in _CUDA_STUBS.items():
        _saved[name] = getattr(torch.cuda, name)
        setattr(torch.cuda, name, stub)


def _remove_stubs() -> None:
    import torch

    for name, fn in _saved.items():
        setattr(torch.cuda, name, fn)
    _saved.clear()


@contextlib.contextmanager
def on_cpu() -> Iterator[None]:
    """Run megatron-core on the CPU on this thread (a no-op where CUDA is present)."""
    global _depth
    import torch

    if torch.cuda.is_available():
        yield
        return
    from openrlhf_oppo import compat

    compat.apply()  # OpenRLHF's own CPU patches: its losses are imported beside Megatron
    with _lock:
        if _depth == 0:
            _install_stubs()
        _depth += 1
    try:
        with _mode_class()():
            yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _remove_stubs()
