"""The CUDA path on a machine without a GPU: CPU tensors tagged with the device they would be on.

Under `fake_cuda()` every tensor the code places on `cuda` (a factory's `device=`, `.to`, `.cuda()`, a module's
`.to`) is computed on the CPU and tagged `cuda:N`; each op's result carries its inputs' device, and an op that mixes
devices raises `DeviceMismatchError` where CUDA would raise - so a device bug (a CPU `labels` meeting CUDA rows in
`torch.where`, a CPU generator drawing into CUDA tensors) fails a test here, in the first minute, instead of on a lent
GPU. Values are real, so data-dependent code (`.item()`, `.tolist()`, indexing) runs on (PyTorch's FakeTensorMode has no
values, and its CUDA indexing needs a CUDA build). Tags live on storages, so views, `.data`, `nn.Parameter` and a
module's `.to` keep them.

What CUDA allows, this allows: 0-dim CPU tensors beside CUDA ones, CPU index tensors into CUDA tensors, `copy_` across
devices. What only a GPU can show is not checked: kernels and numerics (CUDA autocast runs as the CPU's), CUDA graphs
(`ADAFLASH_CUDA_GRAPHS=0` under the mode), streams, memory. `torch.cuda`'s queries answer as one GPU with the host's
memory. Threads started under it run under it too. `ADAFLASH_FAKE_CUDA=1` puts a whole process under it when its
device resolves to CUDA (`models/device/placement.py`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref
from typing import Any, Iterator
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

_CPU = torch.device("cpu")
_DEVICE_OF = torch.Tensor.device.__get__  # (a new method-wrapper each access, equal to the mode's `func`)
_IS_CUDA = torch.Tensor.is_cuda.__get__
_IS_CPU = torch.Tensor.is_cpu.__get__
# Ops CUDA runs with operands on several devices (a CPU index into a CUDA tensor; a copy between devices).
_MIXING = {torch.Tensor.copy_, torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
           torch.Tensor.index_put, torch.index_put, torch.Tensor.to}
_IN_PLACE_MIXING = {torch.Tensor.copy_, torch.Tensor.__setitem__, torch.Tensor.index_put_}
# Two tensors in, no new tensor out: `param.data = moved` (a module's .to) makes the parameter share the moved storage,
# whose tag it then reads.
_QUERIES = {torch._has_compatible_shallow_copy_type, torch.Tensor.data.__set__}


class DeviceMismatchError(RuntimeError):
    """An op met tensors (or a generator) on different devices: what CUDA would have raised."""


class TaggedGenerator(torch.Generator):
    """`torch.Generator(device="cuda")` under the mode: a CPU generator that says where it would draw."""

    def __new__(cls, device: Any = None):
        return super().__new__(cls, device="cpu")

    def __init__(self, device: Any = None) -> None:
        self.tagged = _device(device) if device is not None else _CPU

    @property
    def device(self) -> torch.device:
        return self.tagged


def _normal(device: torch.device) -> torch.device:
    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


class DeviceTags(TorchFunctionMode):
    """The tagging mode: storage -> the device its tensors would be on (one map for the process: a tensor cached under
    one use of the mode, a RoPE table say, is still on its device under the next)."""

    tags: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        real = tensor.device
        if real.type != "cpu":
            return real
        try:
            return self.tags.get(tensor.untyped_storage(), _CPU)
        except (RuntimeError, TypeError):  # no storage (sparse, nested)
            return _CPU

    def _tag(self, out: Any, device: torch.device) -> Any:
        def tag(x):
            if isinstance(x, torch.Tensor):
                storage = x.untyped_storage()
                if device.type == "cpu":
                    self.tags.pop(storage, None)
                else:
                    self.tags[storage] = device
            return x

        tree_map(tag, out)
        return out

    def _copied(self, tensor: torch.Tensor, device: torch.device, **kwargs) -> torch.Tensor:
        """`tensor` moved to `device`: a new CPU tensor (as a real move makes a copy) tagged with it."""
        return self._tag(tensor.to(_CPU, copy=True, **kwargs), _normal(device))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == _DEVICE_OF:
            return self.device_of(args[0])
        if func in _QUERIES:
            return func(*args, **kwargs)
        if func == _IS_CUDA:
            return self.device_of(args[0]).type == "cuda"
        if func == _IS_CPU:
            return self.device_of(args[0]).type == "cpu"
        if func is torch.Tensor.get_device:
            device = self.device_of(args[0])
            return -1 if device.type == "cpu" else device.index
        if func is torch.Tensor.to:
            return self._to(args, kwargs)
        if func is torch.Tensor.type_as:
            return self._to((args[0], args[1]), {})
        if func is torch.Tensor.cuda:
            device = args[1] if len(args) > 1 else kwargs.pop("device", None)
            return self._copied(args[0], _device(device if device is not None else "cuda"))
        if func is torch.Tensor.cpu:
            return args[0].to(_CPU, copy=True) if self.device_of(args[0]).type != "cpu" else args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func in (torch.Tensor.numpy, torch.Tensor.__array__) and self.device_of(args[0]).type != "cpu":
            raise DeviceMismatchError("can't convert a cuda tensor to numpy: copy it to the host with .cpu() first")
        named = kwargs.get("device")
        if named is not None:
            named = _device(named)
            kwargs["device"] = _CPU
        where = self._checked(func, args, kwargs, named)
        generator = kwargs.get("generator")
        if generator is not None:
            drawn = generator.device
            if drawn.type != where.type:
                raise DeviceMismatchError(f"{_name(func)}: a {drawn.type} generator draws into {where} tensors")
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if func in _IN_PLACE_MIXING or (name.endswith("_") and not name.startswith("__")) or "out" in kwargs:
            return out  # the output is (part of) the first operand, or `out=`, whose device was checked
        return self._tag(self._unshared(out, inputs, where), where)

    def _checked(self, func, args, kwargs, named: torch.device | None) -> torch.device:
        """The device `func`'s result is on; raises where CUDA would refuse the operands' devices. A 0-dim host
        tensor passed as an operand of its own may sit beside CUDA ones (not one in a list: torch.stack refuses it);
        a host index may index a CUDA tensor (not the reverse); `copy_` copies across devices."""
        direct = [x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)]
        devices = {self.device_of(t) for t in _tensors((args, kwargs))
                   if t.dim() > 0 or self.device_of(t).type != "cpu" or not any(t is d for d in direct)}
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func in _MIXING and first is not None:
            here = self.device_of(first)
            if func is not torch.Tensor.copy_ and here.type == "cpu" and len(devices) > 1:
                raise DeviceMismatchError(f"{_name(func)}: a cuda index into a cpu tensor")
            return named or here
        out = kwargs.get("out")
        if out is not None:
            devices |= {self.device_of(t) for t in _tensors(out)}
        if named is not None and devices and devices != {named} and out is not None:
            devices.add(named)
        if len(devices) > 1:
            raise DeviceMismatchError(f"{_name(func)}: tensors on {sorted(map(str, devices))} "
                                      f"(shapes {[tuple(t.shape) for t in _tensors((args, kwargs))]})")
        return named or (devices.pop() if devices else _CPU)

    def _unshared(self, out, inputs: set[int], where: torch.device):
        """`out` with every tensor sharing an input's memory but not its device copied: `as_tensor(cuda_x,
        device="cpu")` is a copy on CUDA, and tagging the shared memory would move `cuda_x` too."""

        def unshare(x):
            if isinstance(x, torch.Tensor) and id(x.untyped_storage()) in inputs and self.device_of(x) != where:
                return x.clone()
            return x

        return tree_map(unshare, out)

    def _to(self, args, kwargs):
        tensor, rest = args[0], args[1:]
        copy = kwargs.pop("copy", False)
        if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device (tagged) and dtype
            device, dtype = self.device_of(rest[0]), rest[0].dtype
            memory_format = None
        else:
            device, dtype, _, memory_format = torch._C._nn._parse_to(*rest, **kwargs)
        options = {key: value for key, value in (("dtype", dtype), ("memory_format", memory_format),
                                                 ("copy", copy)) if value}
        here = self.device_of(tensor)
        if device is None or _normal(device) == here:
            return self._tag(tensor.to(**options), here)  # (itself, or a copy on its device)
        options.pop("copy", None)
        if device.type == "cpu":
            return tensor.to(_CPU, copy=True, **options)
        return self._copied(tensor, device, **options)


class _HostAutocast(torch.autocast):
    """`torch.autocast("cuda", ...)` under the mode: the CPU's autocast, which is what casts these tensors' ops."""

    def __init__(self, device_type: str, *args, **kwargs) -> None:
        super().__init__("cpu" if device_type == "cuda" else device_type, *args, **kwargs)


class _CurrentDevice(contextlib.nullcontext):
    """`torch.cuda.device(d)` under the mode: one device, nothing to switch (a class, as torch's own isinstance
    checks need)."""

    def __init__(self, device: Any = None) -> None:
        super().__init__()
        self.idx = 0


def _loader(mode: DeviceTags, load):
    """`torch.load(..., map_location=cuda)` under the mode: loaded on the CPU, every tensor tagged."""

    def loaded(*args, map_location=None, **kwargs):
        where = torch.device(map_location) if isinstance(map_location, (str, torch.device)) else None
        if where is None or where.type != "cuda":
            return load(*args, map_location=map_location, **kwargs)
        return mode._tag(load(*args, map_location="cpu", **kwargs), _normal(where))

    return loaded


def _under(mode: DeviceTags, run):
    """A thread's `run` under the mode (a torch function mode is the thread's own: the engine's thread, the server's,
    would otherwise see `torch.cuda` say yes with nothing tagged)."""

    def run_under(thread):
        with mode:
            return run(thread)

    return run_under


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _device(device: Any) -> torch.device:
    """A device argument (`"cuda"`, `"cuda:1"`, an index, a torch.device) with its index (cuda -> cuda:0)."""
    return _normal(torch.device("cuda", device) if isinstance(device, int) else torch.device(device))


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _host_memory() -> tuple[int, int]:
    from adaflash.models.device.memory import free_memory

    free = free_memory("cpu") or 0
    return free, free


@contextlib.contextmanager
def fake_cuda(devices: int = 1) -> Iterator[DeviceTags]:
    """Run the CUDA path on the CPU, device-checked: tensors placed on `cuda` are tagged, and `torch.cuda` answers as
    `devices` GPUs with the host's memory. CUDA graphs are switched off (they need a GPU)."""
    mode = DeviceTags()
    fake = torch.cuda
    patches = [
        mock.patch.object(fake, "is_available", lambda: True),
        mock.patch.object(fake, "device_count", lambda: devices),
        mock.patch.object(fake, "current_device", lambda: 0),
        mock.patch.object(fake, "set_device", lambda device: None),
        mock.patch.object(fake, "synchronize", lambda device=None: None),
        mock.patch.object(fake, "empty_cache", lambda: None),
        mock.patch.object(fake, "get_device_name", lambda device=None: "fake CUDA (CPU tensors tagged cuda)"),
        mock.patch.object(fake, "is_bf16_supported", lambda *a, **k: True),
        mock.patch.object(fake, "mem_get_info", lambda device=None: _host_memory()),
        mock.patch.object(fake, "memory_reserved", lambda device=None: 0),
        mock.patch.object(fake, "memory_allocated", lambda device=None: 0),
        mock.patch.object(fake, "max_memory_allocated", lambda device=None: 0),
        mock.patch.object(fake, "reset_peak_memory_stats", lambda device=None: None),
        mock.patch.object(fake, "device", _CurrentDevice),
        mock.patch.object(torch, "Generator", TaggedGenerator),
        mock.patch.object(torch, "autocast", _HostAutocast),
        mock.patch.object(torch, "load", _loader(mode, torch.load)),
        mock.patch.object(threading.Thread, "run", _under(mode, threading.Thread.run)),
        mock.patch.dict(os.environ, {"ADAFLASH_CUDA_GRAPHS": "0"}),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        stack.enter_context(mode)
        yield mode


def install() -> None:
    """Put the rest of this process under `fake_cuda()` (`ADAFLASH_FAKE_CUDA=1`)."""
    global _installed
    if _installed is None:
        _installed = fake_cuda()
        _installed.__enter__()


_installed: contextlib.AbstractContextManager | None = None
