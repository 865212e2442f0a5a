"""GPU code paths walked on a CPU: models whose weights are fake tensors on `cuda:0`.

A CPU test cannot see a tensor on the wrong device: every tensor is on the CPU. Inside
`fake_cuda(model, ...)` each given module's parameters and buffers are `FakeTensor`s that
report `cuda:0` over meta storage (no memory, no values) and a `FakeTensorMode` is active, so
an op that meets a CPU tensor and a fake CUDA one raises `FakeTensorDeviceMismatchError`, as a
GPU would raise its device-mismatch error. Tensors made inside the context are fake too:
`torch.empty(..., device=cuda)` gives a fake CUDA tensor, a factory without a device a fake CPU
one.

What a CPU-only torch build cannot fake, and how a check stands without it:
- autograd through a fake CUDA tensor aborts the process (`AccumulateGrad` asks for a CUDA
  device guard), so the fake weights do not require gradients and the context runs under
  `torch.no_grad()`: a training step is checked up to its loss, not through `backward`;
- a CUDA device without an index (`"cuda"`, `.cuda()`) is read as `cuda:0`;
- values do not exist: `.item()`, `.tolist()` and printing fail, as does a collective (gloo
  cannot send a meta tensor);
- CUDA streams and events (`torch.cuda.Stream`, `current_stream`, `record_stream`) are not
  faked, and the modes are this thread's: code run on another thread sees real tensors;
- a library that picks its accelerator when first imported (DeepSpeed) must be imported before
  the context, or it takes the fake device for a GPU.

`torch.cuda.is_available()` answers True inside, so code that picks its device by asking it
takes its GPU branch; `current_device`, `device_count`, `synchronize` and `empty_cache` answer
as one idle GPU would. Used by the device checks in `tests/` (`STYLE.md` 27).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

CUDA = torch.device("cuda", 0)

_STUBS = {
    "is_available": lambda: True,
    "current_device": lambda: 0,
    "device_count": lambda: 1,
    "synchronize": lambda *args, **kwargs: None,
    "empty_cache": lambda: None,
}


def _fake(mode, t: torch.Tensor) -> torch.Tensor:
    from torch._subclasses.fake_tensor import FakeTensor

    return FakeTensor(mode, torch.empty(t.shape, dtype=t.dtype, device="meta"), CUDA)


def to_fake_cuda(mode, module: torch.nn.Module) -> None:
    """Replace every parameter and buffer of `module` (in place) with a fake CUDA twin."""
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                sub._parameters[name] = torch.nn.Parameter(_fake(mode, p.detach()), requires_grad=False)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = _fake(mode, b)


def _guard_mode(mode):
    """Some of torch's Python bindings (indexing, `contiguous`, ...) take a CUDA device guard
    for a CUDA tensor, which a CPU-only build has not. Such a call on a fake CUDA tensor is
    answered on fake `meta` twins of its fake CUDA arguments, and a tensor result made a fake
    CUDA tensor of the same size (values and aliasing do not exist here). Its other tensors
    must be on the fake CUDA device, or be CPU scalars or (for indexing) CPU indices, as on a
    GPU."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorDeviceMismatchError
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten, tree_map

    meta = torch.device("meta")

    def twin(t, device):
        return FakeTensor(mode, torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta"), device)

    def check(func, args, kwargs):
        indices = args[1:2] if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) else ()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dim() > 0:
                if not any(t is i or (isinstance(i, tuple) and any(t is j for j in i)) for i in indices):
                    error = FakeTensorDeviceMismatchError(func, CUDA, t.device)
                    error.args = (f"{func.__name__}: a {tuple(t.shape)} CPU tensor beside a tensor on {CUDA}",)
                    raise error

    def indexed(d, device_arg: bool = False):
        """"cuda" / torch.device("cuda") name the current device, cuda:0; so does a bare index
        where a device is expected (`device=torch.cuda.current_device()`, `.to(0)`)."""
        if isinstance(d, str) and d == "cuda":
            return CUDA
        if isinstance(d, torch.device) and d.type == "cuda" and d.index is None:
            return CUDA
        if device_arg and isinstance(d, int) and not isinstance(d, bool):
            return torch.device("cuda", d)
        return d

    class GuardFree(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.cuda:
                return args[0].to(CUDA, **{k: v for k, v in kwargs.items() if k == "non_blocking"})
            if func is not torch.device:
                to = func is torch.Tensor.to
                args = [indexed(a, device_arg=to and i == 1) for i, a in enumerate(args)]
                kwargs = {k: indexed(v, device_arg=k == "device") for k, v in kwargs.items()}
            try:
                return func(*args, **kwargs)
            except RuntimeError as e:
                if "not linked with support for cuda" not in str(e):
                    raise
                if not any(is_fake_cuda(t) for t in tree_flatten((args, kwargs))[0]):
                    raise
            check(func, args, kwargs)
            args, kwargs = tree_map(lambda t: twin(t, meta) if is_fake_cuda(t) else t, (args, kwargs))
            out = func(*args, **kwargs)
            return tree_map(lambda t: twin(t, CUDA) if isinstance(t, FakeTensor) and t.device == meta else t, out)

    return GuardFree()


def _mode_class():
    from torch._subclasses.fake_tensor import FakeTensorMode

    class NoDeviceMode(FakeTensorMode):
        """Never materialises a CUDA tensor: the mode would, seeing `is_available()` answer True,
        constant-fold a small real tensor's move to the device and fail on this build."""

        @property
        def avoid_device_init(self) -> bool:
            return True

    return NoDeviceMode


@contextlib.contextmanager
def fake_cuda(*modules: torch.nn.Module) -> Iterator[object]:
    """Run with `modules`' weights on a fake `cuda:0` (see the module doc); yields the mode.
    The modules keep their fake weights afterwards: build them for the check."""
    mode = _mode_class()(allow_non_fake_inputs=True)
    for module in modules:
        to_fake_cuda(mode, module)
    saved = {name: getattr(torch.cuda, name) for name in _STUBS}
    for name, stub in _STUBS.items():
        setattr(torch.cuda, name, stub)
    try:
        with torch.no_grad(), mode, _guard_mode(mode):
            yield mode
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


def is_fake_cuda(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) and t.device.type == "cuda"
