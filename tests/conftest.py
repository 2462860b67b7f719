"""Shared fixtures: tiny seeded HF checkpoints of each supported family, written once per session."""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import write_tiny_checkpoint

# name -> (family, tied embeddings, seed). Untied heads give diverse greedy text; tied ones test weight sharing.
TINY_MODELS = {
    "llama": ("llama", False, 0),
    "llama-tied": ("llama", True, 1),
    "qwen2": ("qwen2", False, 2),
    "qwen3": ("qwen3", False, 3),
    "qwen3-tied": ("qwen3", True, 4),
}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        name: str(write_tiny_checkpoint(root / name, family, tie=tie, seed=seed))
        for name, (family, tie, seed) in TINY_MODELS.items()
    }


# Tiny models gain nothing from threads, and a busy second core makes OpenMP wait in 16 ms slices.
torch.set_num_threads(1)
# The suite runs on the CPU, GPU or not (tests that take a device fixture move to CUDA themselves, `pytest -m cuda`).
os.environ["ADAFLASH_DEVICE"] = "cpu"
if os.environ.get("ADAFLASH_FAKE_CUDA") == "1":  # `pytest -m cuda` on the CPU, device-checked (models/device/fake_cuda.py)
    from adaflash.models.device.fake_cuda import install

    install()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """The real embedded target, converted once into the user cache (about a minute on first use)."""
    from adaflash.models.targets.registry import resolve_target

    return str(resolve_target("smollm2-135m"))


@pytest.fixture(scope="session")
def tiny_chat_checkpoint(tmp_path_factory, smollm2_dir) -> str:
    """A 2-layer random Llama with SmolLM2's real tokenizer and chat template: CLI tests in seconds."""
    import shutil
    from pathlib import Path

    from tests.helpers import tiny_hf_model

    path = tmp_path_factory.mktemp("tiny-chat")
    tiny_hf_model("llama", tie=False, seed=5, vocab=49152, eos=2).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(smollm2_dir) / name).exists():
            shutil.copy(Path(smollm2_dir) / name, path / name)
    return str(path)


@pytest.fixture(scope="session")
def tiny_soft_data(tiny_checkpoints, tmp_path_factory) -> str:
    """Regenerated data of the tiny llama (features of layers 1, 2) with the target's top-8 log-probabilities
    stored per response token (soft targets); used by training and evaluation tests."""
    from tests.helpers import regenerate_tiny_data

    return regenerate_tiny_data(tiny_checkpoints["llama"], tmp_path_factory.mktemp("soft-data"),
                                [(f"p{i}", "chat" if i % 2 else "math") for i in range(10)],
                                max_new_tokens=24, batch_size=4, shard_size=4, top_logprobs=8)
