"""The CUDA path, device-checked on a machine without a GPU (models/device/fake_cuda.py).

Under `fake_cuda()` the tensors the code places on CUDA are CPU tensors tagged `cuda:0`, and an op that mixes devices
raises where CUDA would. These tests run the CUDA code path of generation (AR, speculative decoding, every length
policy, prompt lookup, sampling, the engine at batch 4), training (a draft vocabulary, distillation) and the length
head's training and evaluation that way; `tests/gpu` runs `make gpu-check` / `make gpu-drafter` with FAKE_CUDA=1.
The checker itself is tested first: what it must refuse and what CUDA allows.
"""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.models.device.fake_cuda import DeviceMismatchError, fake_cuda
from adaflash.speculative.sampling import SamplingParams

PROMPTS = ([3, 17, 29, 5, 60], [7, 7, 41], [11, 90, 23, 52, 8, 19, 33], [64])


@pytest.fixture
def fake(monkeypatch):
    """The process's device is CUDA, faked; our CPU kernels off (CUDA never runs them)."""
    from adaflash.models.device import placement as process_device

    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
    monkeypatch.setenv("ADAFLASH_DEVICE", "cuda")
    monkeypatch.setattr(process_device, "_current", None)
    with fake_cuda() as mode:
        yield mode


# ---------------------------------------------------------------- the checker


def test_the_checker_refuses_what_cuda_refuses(fake):
    import numpy as np

    rows = torch.randn(4, 8, device="cuda")
    labels = torch.arange(4)  # built on the host
    with pytest.raises(DeviceMismatchError, match="where"):
        torch.where(labels[:, None] > 1, rows, rows)  # issue 56's first crash: labels meet a head's CUDA rows
    with pytest.raises(DeviceMismatchError, match="linear"):
        torch.nn.Linear(8, 3).to("cuda")(torch.randn(2, 8))
    with pytest.raises(DeviceMismatchError, match="embedding"):
        torch.nn.Embedding(10, 8).to("cuda")(torch.tensor([1, 2]))
    with pytest.raises(DeviceMismatchError, match="generator"):
        torch.rand(3, device="cuda", generator=torch.Generator().manual_seed(0))
    with pytest.raises(DeviceMismatchError, match="numpy"):
        rows.numpy()
    with pytest.raises(DeviceMismatchError, match="numpy"):
        np.asarray(rows)
    with pytest.raises(DeviceMismatchError, match="cuda index into a cpu tensor"):
        labels[torch.tensor([0, 1], device="cuda")]
    with pytest.raises(DeviceMismatchError, match="stack"):
        torch.stack([rows.sum(), torch.tensor(1.0)])  # 0-dim host tensors pass as operands, not in a list
    with pytest.raises(DeviceMismatchError, match="add"):
        torch.add(rows, 1, out=torch.zeros(4, 8))


def test_the_checker_allows_what_cuda_allows_and_keeps_tags(fake):
    rows = torch.randn(4, 8, device="cuda")
    assert rows.device == torch.device("cuda", 0) and rows.is_cuda and not rows.is_cpu
    assert rows[torch.tensor([0, 2])].device.type == "cuda"  # a host index into a CUDA tensor
    assert (rows * torch.tensor(2.0)).device.type == "cuda"  # a 0-dim host tensor beside CUDA ones
    host = torch.zeros(4, 8)
    host.copy_(rows)  # copies across devices
    assert host.device.type == "cpu" and rows.cpu().device.type == "cpu" and rows.device.type == "cuda"
    assert torch.as_tensor(rows, device="cpu").device.type == "cpu" and rows.is_cuda  # a copy, the source stays
    assert rows[1:].device.type == rows.T.device.type == rows.float().device.type == "cuda"  # views and casts
    assert torch.zeros(2).type_as(rows).is_cuda and torch.zeros(2).cuda("cuda:0").is_cuda
    assert torch.zeros(2, device=0).is_cuda
    module = torch.nn.Linear(8, 3).to("cuda")
    assert module.weight.device.type == "cuda" and module(rows).device.type == "cuda"
    assert torch.nn.Parameter(rows).device.type == "cuda" and torch.empty(2, device=rows.device).is_cuda
    assert rows.sum().item() == pytest.approx(float(rows.cpu().sum())) and torch.cuda.is_available()
    generator = torch.Generator(device="cuda")
    assert generator.device.type == "cuda" and torch.rand(3, device="cuda", generator=generator).is_cuda


def test_threads_started_under_the_mode_run_under_it(fake):
    import threading

    rows, seen = torch.randn(2, device="cuda"), []
    thread = threading.Thread(target=lambda: seen.append((rows.device.type, torch.zeros(2, device="cuda").is_cuda)))
    thread.start()
    thread.join()
    assert seen == [("cuda", True)]


def test_leaving_the_mode_restores_torch():
    import os
    import threading

    before = (torch.cuda.is_available, torch.Generator, torch.load, torch.autocast, threading.Thread.run,
              os.environ.get("ADAFLASH_CUDA_GRAPHS"))
    with fake_cuda():
        assert torch.cuda.is_available() and os.environ["ADAFLASH_CUDA_GRAPHS"] == "0"
    assert (torch.cuda.is_available, torch.Generator, torch.load, torch.autocast, threading.Thread.run,
            os.environ.get("ADAFLASH_CUDA_GRAPHS")) == before


# ---------------------------------------------------------------- generation and the engine


@pytest.fixture(scope="module")
def reference(tiny_checkpoints):
    """Greedy outputs of the tiny Qwen3 on the CPU: what the CUDA path must give, token for token (fp32)."""
    from adaflash.models.targets.model import load_target
    from adaflash.speculative.reference import autoregressive_generate

    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32, device="cpu")
    return [autoregressive_generate(target, list(p), 16).token_ids for p in PROMPTS]


def _drafter(target, vocab=None, head: bool = False):
    from adaflash.models.drafters.draft_vocab import DraftVocab
    from adaflash.models.drafters.config import DrafterConfig
    from adaflash.models.drafters.checkpoint import init_drafter
    from adaflash.speculative.proposer import DFlashProposer

    drafter = init_drafter(DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=8), seed=1)
    if vocab is not None:
        drafter.set_draft_vocab(DraftVocab(torch.tensor(sorted(set(vocab)), dtype=torch.long),
                                           target.config.vocab_size))
    return DFlashProposer(drafter, target)


def test_generation_on_the_cuda_path(fake, tiny_checkpoints, reference):
    """AR and the reference speculative loop, greedy and sampled, with a trimmed draft vocabulary."""
    from adaflash.models.targets.model import load_target
    from adaflash.speculative.reference import autoregressive_generate, speculative_generate

    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32)
    assert target.device == torch.device("cuda", 0) and target.new_cache(1, 8).k.is_cuda
    proposer = _drafter(target, vocab=[t for r in reference for t in r] + [6, 8])
    sampled = SamplingParams(temperature=1.0, top_k=8)
    for prompt, expected in zip(PROMPTS, reference):
        assert autoregressive_generate(target, list(prompt), 16).token_ids == expected
        assert speculative_generate(target, proposer, list(prompt), 16, draft_length=3).token_ids == expected
        assert len(speculative_generate(target, proposer, list(prompt), 16, sampled, draft_length=3, seed=1).token_ids)
        assert len(autoregressive_generate(target, list(prompt), 8, sampled, seed=2).token_ids) == 8


@pytest.mark.parametrize("policy", ["fixed:3", "heuristic", "throughput", "adaflash", "block-head"])
def test_the_engine_on_the_cuda_path(fake, tiny_checkpoints, reference, policy):
    """Four requests a step, greedy and sampled side by side, prompt lookup before the drafter, every length policy
    (the learned ones reading the drafter's block hidden states through a length head on the device)."""
    from adaflash.engine.engine import Engine
    from adaflash.engine.request import Request
    from adaflash.models.drafters.length_head import BlockLengthHead, LengthHeadConfig, PositionAcceptanceHead
    from adaflash.models.targets.model import load_target
    from adaflash.speculative.cost_model import CostModel
    from adaflash.speculative.policies import build_length_policy
    from adaflash.speculative.prompt_lookup import PromptLookup

    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32)
    proposer = _drafter(target)
    head = None
    if policy in ("adaflash", "block-head"):
        kind = "position" if policy == "adaflash" else "block"
        config = LengthHeadConfig(kind=kind, hidden_size=target.config.hidden_size, block_size=8, head_dim=16)
        head = (PositionAcceptanceHead if kind == "position" else BlockLengthHead)(config).to(target.device).eval()
    cost = CostModel(total_tokens=(1, 8, 32), verify_s=(0.01, 0.0102, 0.011), draft_s=0.001)
    engine = Engine(target, proposer, build_length_policy(policy, cost, head), max_batch=4, max_len=64,
                    prompt_lookup=PromptLookup(num_tokens=4, length="all"))
    greedy = [Request(f"g{i}", list(p), 16) for i, p in enumerate(PROMPTS)]
    sampled = [Request(f"s{i}", list(p), 8, sampling=SamplingParams(temperature=0.8, top_p=0.9), seed=i)
               for i, p in enumerate(PROMPTS)]
    for g, s in zip(greedy, sampled):
        engine.add_request(g)
        engine.add_request(s)
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in greedy] == reference
    assert all(len(r.output_ids) == 8 for r in sampled)
    assert sum(k for r in greedy + sampled for k in r.draft_lengths) > 0  # the drafting path ran


def test_the_cost_profile_on_the_cuda_path_times_the_drafter_by_its_requests(fake, tiny_checkpoints):
    """On a GPU the drafter's requests share one pass: the profile times it by their number (the throughput
    policies then price a step's drafting as that one pass)."""
    from adaflash.models.targets.model import load_target
    from adaflash.speculative.cost_model import profile_cost_model

    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32)
    profile = profile_cost_model(target, _drafter(target), max_tokens=32, context=16, repeats=1)
    assert profile.batched_drafter and profile.draft_batches == (1, 2, 4) and all(s > 0 for s in profile.draft_batch_s)


# ---------------------------------------------------------------- training and the length head


@pytest.mark.parametrize("loss", ["ce", "rkl"])
def test_a_training_step_with_a_draft_vocabulary_on_the_cuda_path(fake, tiny_checkpoints, tiny_soft_data, tmp_path,
                                                                  loss):
    """Both GPU configs trim the drafter's vocabulary; `rkl` is the distillation loss (the target's law computed in
    the step). The labels are built on the host, the head's rows live on the device."""
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.training.trainer import TrainConfig, train

    cfg = TrainConfig(data_dir=tiny_soft_data, out_dir=str(tmp_path / "run"), model=tiny_checkpoints["llama"],
                      mask_token_id=5, num_layers=1, block_size=4, target_layer_ids=(1, 2), loss=loss, max_steps=2,
                      sequences_per_step=2, anchors_per_sequence=4, log_every=1, save_every=1, cache_teacher=False,
                      draft_vocab_size=24)
    final = train(cfg, progress=False)
    drafter = load_drafter(final, device="cpu")
    assert drafter.draft_vocab is not None and drafter.draft_vocab.size == 24
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 2
    assert train(cfg, progress=False) == final  # resumes from the checkpoint, loaded onto the device


def test_length_head_training_and_evaluation_on_the_cuda_path(fake):
    """The head trains on the device from host outcomes, and its evaluation reads them there."""
    from adaflash.formats.outcomes import Outcomes
    from adaflash.training.length_head import LengthHeadTrainConfig, train_length_head

    g = torch.Generator().manual_seed(0)
    n, block, dim = 64, 4, 16
    hidden = torch.randn(n, block, dim, generator=g)
    drafted = torch.full((n,), block - 1)
    accepted = torch.randint(0, block, (n,), generator=g)
    for kind in ("position", "block"):
        cfg = LengthHeadTrainConfig(kind=kind, head_dim=8, epochs=2, batch_size=16, lr=1e-2)
        head, report = train_length_head(Outcomes(hidden=hidden, drafted=drafted, accepted=accepted), cfg,
                                         hidden_size=dim, block_size=block, device="cuda")
        assert next(head.parameters()).is_cuda and report["n_train"] + report["n_held_out"] == n
