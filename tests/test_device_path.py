"""The device-agnostic path: what runs on CUDA, exercised on every machine.

Each test runs on the CPU with our CPU kernels switched off (ADAFLASH_KERNELS=stock: torch's ops only, the exact code
CUDA runs) and, marked `cuda`, on a GPU when there is one (`pytest -m cuda`). Greedy decoding is token-identical to
transformers' and to plain decoding in fp32 on both devices; in bf16 (CUDA's default) a verify pass and a decode step
may round a near-tie differently, which `test_bf16_speculative_parts_only_at_near_ties` bounds; sampling keeps the
target's law (chi-square against the exact law).
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from adaflash.engine.engine import Engine
from adaflash.engine.request import Request
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, save_drafter
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target
from adaflash.speculative.policies import build_length_policy
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate, speculative_generate
from adaflash.speculative.sampling import SamplingParams
from tests.helpers import (TINY_VOCAB, decode_batches, drafting_happened, exact_joint, law_pvalue, sampled_counts,
                           scripted_dflash)

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
PROMPTS = ([3, 17, 29, 5, 60], [7, 7, 41], [11, 90, 23, 52, 8, 19, 33], [64])


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
def device(request, monkeypatch) -> torch.device:
    """The CPU with our kernels off (torch's ops, as on CUDA), or the GPU; the process's device is restored after."""
    from adaflash.models.device import placement as process_device

    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
    monkeypatch.setenv("ADAFLASH_DEVICE", request.param)
    monkeypatch.setattr(process_device, "_current", None)
    return torch.device(request.param)


def _proposer(target, block: int = 8, seed: int = 0, vocab: list[int] | None = None) -> DFlashProposer:
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=block)
    drafter = init_drafter(cfg, seed=seed)
    if vocab is not None:
        ids = list(dict.fromkeys(vocab))
        drafter.set_draft_vocab(DraftVocab(torch.tensor(ids, dtype=torch.long), TINY_VOCAB))
    return DFlashProposer(drafter, target)


def _hf_greedy(path: str, prompt: list[int], new_tokens: int, device: torch.device) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    ids = torch.tensor([prompt], device=device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_models_land_on_the_device_and_skip_cpu_kernels(tiny_checkpoints, device):
    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32, device=device)
    proposer = _proposer(target)
    assert target.device.type == device.type and proposer.drafter.device.type == device.type
    assert target.layer_steps is None and target.fast_lm_head is None
    assert not any(layer.fast for layer in target.layers)
    assert target.new_cache(2, 8).k.device.type == device.type


@pytest.mark.parametrize("name", ["qwen3", "qwen3-tied", "llama"])
def test_greedy_equals_transformers(tiny_checkpoints, device, name):
    target = load_target(tiny_checkpoints[name], dtype=torch.float32, device=device)
    for prompt in PROMPTS[:2]:
        ours = autoregressive_generate(target, prompt, 24).token_ids
        assert ours == _hf_greedy(tiny_checkpoints[name], prompt, 24, device)


@pytest.mark.parametrize("draft_length", [1, 3, 7])
def test_speculative_greedy_is_lossless(tiny_checkpoints, device, draft_length):
    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.float32, device=device)
    # A draft vocabulary around the target's own continuation, so some drafts are accepted.
    reference = [autoregressive_generate(target, p, 30).token_ids for p in PROMPTS]
    proposer = _proposer(target, vocab=sorted({t for r in reference for t in r})[:12] + [6, 8, 9])
    passes = []
    for prompt, expected in zip(PROMPTS, reference):
        result = speculative_generate(target, proposer, prompt, 30, draft_length=draft_length)
        assert result.token_ids == expected
        passes += result.stats.accept_lengths
    assert max(passes) > 1  # drafts were accepted, not only corrected


def test_cost_profile_on_the_device(tiny_checkpoints, device):
    """The throughput policy's profile: on CUDA its drafter by requests and its verify by requests x new tokens too
    (a grid the policies read), on the CPU by total tokens alone."""
    from adaflash.speculative.cost_model import profile_cost_model

    target = load_target(tiny_checkpoints["qwen3-tied"], dtype=torch.float32, device=device)
    model = profile_cost_model(target, _proposer(target), max_tokens=64, context=16, repeats=1)
    assert model.verify(8) > 0 and model.draft(3) > 0
    if device.type == "cuda":
        assert model.verify_batches == (1, 2, 4, 8) and model.verify_widths == (1, 2, 4, 8)
        assert model.batched_drafter and model.verify(32, requests=4) > 0
    else:
        assert not model.verify_grid_s and not model.batched_drafter


@pytest.mark.parametrize("policy", ["fixed:3", "heuristic"])
def test_engine_batch_equals_reference(tiny_checkpoints, device, policy):
    """Four requests verified in one pass, drafted by a mostly-right drafter: each is the target's greedy output."""
    target = load_target(tiny_checkpoints["qwen3-tied"], dtype=torch.float32, device=device)
    expected = [autoregressive_generate(target, list(p), 20).token_ids for p in PROMPTS]
    proposer = scripted_dflash(target, [list(p) + e for p, e in zip(PROMPTS, expected)], seed=1)
    engine = Engine(target, proposer, build_length_policy(policy), max_batch=4, max_queue=8, max_len=64)
    batches = decode_batches(engine)
    requests = [Request(f"r{i}", list(p), 20) for i, p in enumerate(PROMPTS)]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    assert [r.output_ids for r in requests] == expected
    assert max(batches) == 4
    drafting_happened(requests)


def test_engine_returns_host_features_and_logprobs(tiny_checkpoints, device):
    """What callers keep of a step (data generation's features, the server's log-probabilities) is on the host."""
    target = load_target(tiny_checkpoints["llama"], dtype=torch.float32, device=device)
    engine = Engine(target, None, max_batch=2, max_len=32, capture_layers=(1, 2))
    engine.add_request(Request("a", [3, 4, 5], 4, top_logprobs=3, return_features=True))
    outputs = []
    while engine.has_work():
        outputs += engine.step()
    assert all(o.features.device.type == "cpu" and o.top_logprobs.device.type == "cpu" for o in outputs)


def test_sampling_keeps_the_target_law(tiny_checkpoints, device):
    """Chi-square of 3-token sequences against the exact law: the reference loop and the batched engine, noise drawn
    from each request's generator and used where the probabilities live."""
    target = load_target(tiny_checkpoints["qwen2"], dtype=torch.float32, device=device)
    prompt, params = [3, 14, 15, 92, 65, 35], SamplingParams(temperature=1.0, top_k=3)
    exact = exact_joint(target, prompt, params, 3)
    support = sorted({t for seq in exact for t in seq})
    kept = support[: max(1, len(support) // 2)]
    proposer = _proposer(target, seed=3, vocab=kept + [t for t in range(6, TINY_VOCAB) if t not in kept][:2])
    # Under the fake CUDA device (the CPU dry run) the numerics are the [cpu] case's, which holds the law at full power;
    # what is new there is where each tensor lives, which 200 samples exercise as well as 800 at a quarter of the time.
    samples = 200 if os.environ.get("ADAFLASH_FAKE_CUDA") == "1" else 800
    counts, requests = sampled_counts(target, proposer, prompt, params, exact, samples)
    assert any(a > 1 for r in requests for a in r.accept_lengths)  # drafts were accepted, not only corrected
    assert law_pvalue(counts, exact) > 1e-3


def test_bf16_speculative_parts_only_at_near_ties(tiny_checkpoints, device):
    """bf16 (CUDA's default): a verify pass may round a position differently from a decode step. Speculative output
    equals plain decoding up to the first near-tie, where the two candidates' logits are within bf16 rounding."""
    target = load_target(tiny_checkpoints["qwen3"], dtype=torch.bfloat16, device=device)
    proposer = _proposer(target)
    for prompt in PROMPTS:
        plain = autoregressive_generate(target, prompt, 30).token_ids
        spec = speculative_generate(target, proposer, prompt, 30, draft_length=4).token_ids
        if spec == plain:
            continue
        i = next(j for j, (a, b) in enumerate(zip(plain, spec)) if a != b)
        ids = prompt + plain[:i]
        out = target(torch.tensor(ids), RaggedBatch.build([0], [0], [len(ids)]), target.new_cache(1, len(ids)),
                     logit_indices=torch.tensor([len(ids) - 1]))
        row = out.logits[0].float()
        assert abs(float(row[plain[i]] - row[spec[i]])) <= 0.125 * max(1.0, float(row.abs().max()) / 8)


def test_trainer_steps_on_the_device(tiny_checkpoints, tiny_soft_data, tmp_path, device):
    """The training loop on the device: target features recomputed inside the step, bf16 autocast on CUDA; the
    exported drafter loads."""
    from adaflash.models.device.placement import use_device
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.training.trainer import TrainConfig, train

    use_device(str(device))
    cfg = TrainConfig(data_dir=tiny_soft_data, out_dir=str(tmp_path / "run"), model=tiny_checkpoints["llama"],
                      mask_token_id=5, num_layers=1, block_size=4, target_layer_ids=(1, 2), loss="fkl", max_steps=3,
                      sequences_per_step=2, anchors_per_sequence=4, log_every=1, save_every=2, cache_teacher=False)
    final = train(cfg, progress=False)
    assert load_drafter(final, device="cpu").config.num_layers == 1
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["step"] == 3 and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics if "loss" in m)


@pytest.fixture(scope="module")
def tiny_qwen3_chat(tmp_path_factory, request) -> str:
    """A 2-layer random Qwen3 with SmolLM2's real tokenizer and chat template: `--model DIR` end to end."""
    import shutil
    from pathlib import Path

    from tests.helpers import tiny_hf_model

    try:
        smollm2_dir = request.getfixturevalue("smollm2_dir")
    except FileNotFoundError as exc:  # a GPU machine without the project's packages (make gpu-check)
        pytest.skip(f"SmolLM2's tokenizer is not installed here: {exc}")
    path = tmp_path_factory.mktemp("tiny-qwen3-chat")
    tiny_hf_model("qwen3", tie=False, seed=7, vocab=49152, eos=2).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(smollm2_dir) / name).exists():
            shutil.copy(Path(smollm2_dir) / name, path / name)
    return str(path)


@pytest.mark.parametrize("method", ["ar", "dflash"])
def test_cli_model_dir_generates_transformers_greedy_tokens(tiny_qwen3_chat, device, method, tmp_path, capsys):
    """`adaflash generate --model DIR --device D`: AR and speculative decoding give transformers' greedy tokens."""
    from adaflash.cli import main
    from adaflash.data.prompt import user_messages
    from adaflash.models.targets.registry import load_tokenizer
    from adaflash.models.targets.text_codec import TextCodec

    target = load_target(tiny_qwen3_chat, dtype=torch.float32, device=device)
    drafter = save_drafter(_proposer(target).drafter, tmp_path / "drafter")
    extra = ["--method", "dflash", "--drafter", str(drafter), "--draft-length", "3"] if method == "dflash" else []
    prompt = "Name three prime numbers."
    assert main(["--device", device.type, "generate", "--model", tiny_qwen3_chat, "--dtype", "fp32", "--prompt",
                 prompt, "--max-new-tokens", "16", "--json", *extra]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    codec = TextCodec(load_tokenizer(tiny_qwen3_chat), target.config.eos_token_ids)
    expected = _hf_greedy(tiny_qwen3_chat, codec.encode(messages=user_messages(prompt)), 16, device)
    assert record["token_ids"] == expected[: len(record["token_ids"])] and len(record["token_ids"]) in (16, len(expected))


@pytest.mark.parametrize("name", ["qwen3", "llama-tied"])
def test_static_decode_step_equals_the_ragged_step(tiny_checkpoints, device, name):
    """The decode step a CUDA graph captures (models/targets/decode_graph.py: the whole cache under a position mask, device-side
    position) gives the ragged path's greedy tokens and logits; on CUDA it runs as a replayed graph."""
    from adaflash.models.kv_cache.ragged import RaggedBatch

    target = load_target(tiny_checkpoints[name], dtype=torch.float32, device=device)
    target.static_decode = False
    reference = [autoregressive_generate(target, p, 24).token_ids for p in PROMPTS]
    target.static_decode = True
    assert [autoregressive_generate(target, p, 24).token_ids for p in PROMPTS] == reference
    caches = []
    for static in (False, True):
        target.static_decode = static
        cache = target.new_cache(1, 40)
        target(torch.tensor(PROMPTS[2]), RaggedBatch.build([0], [0], [len(PROMPTS[2])]), cache)
        rows = [target(torch.tensor([t]), RaggedBatch.build([0], [len(PROMPTS[2]) + i], [1]), cache).logits
                for i, t in enumerate(reference[2][:6])]
        caches.append((torch.cat(rows), cache))
    (plain, plain_cache), (static, static_cache) = caches
    assert torch.allclose(plain, static, atol=1e-4, rtol=1e-4)
    assert static_cache.lengths == plain_cache.lengths and static_cache.decode_graphs
    assert torch.allclose(plain_cache.contents(0)[0], static_cache.contents(0)[0], atol=1e-5)
