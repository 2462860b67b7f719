"""The decode graph's ownership and its capture's device (models/targets/decode_graph.py).

The static decode step runs eagerly on the CPU (what a CUDA graph captures); CUDA's capture and replay calls are
replaced here by recorders, so the device and stream they are made on are checked without a GPU.
"""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch

from adaflash.models.targets import decode_graph
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target
from adaflash.speculative.reference import autoregressive_generate

PROMPT = [3, 17, 29, 5, 60]


@pytest.fixture
def target(tiny_checkpoints):
    model = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32, device="cpu")
    model.static_decode = True  # the step a graph captures, eagerly
    return model


@contextlib.contextmanager
def _no_gc():
    """Only reference counting frees objects: what a captured CUDA graph in a cycle leaves to (never collected)."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _decode_steps(target, cache, steps: int = 3) -> None:
    n = len(PROMPT)
    target(torch.tensor(PROMPT), RaggedBatch.build([0], [0], [n]), cache)
    for i in range(steps):
        target(torch.tensor([7]), RaggedBatch.build([0], [n + i], [1]), cache)


def test_cache_and_its_decode_graph_are_freed_by_refcount(target):
    with _no_gc():
        cache = target.new_cache(1, 16)
        _decode_steps(target, cache)
        assert cache.decode_graphs, "the static decode path did not run"
        cache_ref, graph_ref = weakref.ref(cache), weakref.ref(cache.decode_graphs[0])
        del cache
        assert cache_ref() is None and graph_ref() is None


def test_autoregressive_generate_leaves_no_cache_behind(target, monkeypatch):
    made = []
    new_cache = target.new_cache

    def recorded(*args):
        cache = new_cache(*args)
        made.append(weakref.ref(cache))
        return cache

    monkeypatch.setattr(target, "new_cache", recorded)
    with _no_gc():
        autoregressive_generate(target, PROMPT, 6)
        assert len(made) == 1 and made[0]() is None


class _CudaRecorder:
    """Stand-ins for the torch.cuda calls a capture and a replay make, recording the device each runs under."""

    def __init__(self) -> None:
        self.current = [torch.device("cuda", 0)]  # a fresh thread's current device
        self.streams: list[_Stream] = []
        self.captures: list[tuple[torch.device, object]] = []
        self.replays: list[torch.device] = []

    @contextlib.contextmanager
    def device(self, device):
        self.current.append(torch.device(device))
        try:
            yield
        finally:
            self.current.pop()

    def Stream(self, device=None):  # noqa: N802 (torch's name)
        stream = _Stream(torch.device(device) if device is not None else self.current[-1])
        self.streams.append(stream)
        return stream

    def current_stream(self, device=None):
        return _Stream(torch.device(device) if device is not None else self.current[-1])

    @contextlib.contextmanager
    def stream(self, stream):
        with self.device(stream.device):
            yield

    def CUDAGraph(self):  # noqa: N802
        recorder = self

        class Graph:
            def replay(self):
                recorder.replays.append(recorder.current[-1])

        return Graph()

    @contextlib.contextmanager
    def graph(self, graph, stream=None):
        self.captures.append((self.current[-1], stream))
        with self.stream(stream) if stream is not None else contextlib.nullcontext():
            yield


class _Stream:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def wait_stream(self, other) -> None:
        pass


def test_capture_and_replay_run_on_the_tensors_device(target, monkeypatch):
    """With cuda:0 current, the side stream is made on the tensors' device (the CPU's stand in for cuda:N's), named to
    the capture, and both the capture and every replay run with that device current."""
    cuda = _CudaRecorder()
    for name in ("device", "Stream", "current_stream", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(decode_graph, "graphs_enabled", lambda device: True)
    cache = target.new_cache(1, 16)
    graph = decode_graph.DecodeGraph(target, cache, 0)
    graph(cache, torch.tensor([7]), 5)
    graph(cache, torch.tensor([8]), 6)
    here = torch.device("cpu")
    (side,) = cuda.streams
    assert side.device == here
    assert cuda.captures == [(here, side)]
    assert cuda.replays == [here, here]
