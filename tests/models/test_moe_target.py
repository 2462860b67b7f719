"""Qwen3-MoE targets (the paper's Qwen3-Coder-30B-A3B family) against transformers, on tiny random configs.

Each device test runs on the CPU's torch path (ADAFLASH_KERNELS=stock, the code CUDA runs), on the CPU with our kernels
where they run (the dense layers' packed linears; the experts stay torch's), and, marked `cuda`, on a GPU when there is
one (`pytest -m cuda`; `ADAFLASH_FAKE_CUDA=1` on a CPU). fp32 throughout: greedy tokens equal transformers'.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from adaflash.models.targets.config import TransformerConfig, UnsupportedModelError
from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.model import load_target, target_from_hf_tensors
from adaflash.speculative.proposer import DFlashProposer
from adaflash.speculative.reference import autoregressive_generate, speculative_generate
from tests.helpers import TINY_VOCAB

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
PROMPTS = ([3, 17, 29, 5, 60], [7, 7, 41, 88])
# name -> (config overrides, seed): 8 experts, top 2, one dense (mlp_only) layer; and every other layer sparse, the top-k
# weights not renormalised.
TINY_MOE = {
    "moe": (dict(mlp_only_layers=[1], decoder_sparse_step=1, norm_topk_prob=True), 11),
    "moe-step2": (dict(mlp_only_layers=[], decoder_sparse_step=2, norm_topk_prob=False), 12),
}
# Qwen3-Coder-30B-A3B's config.json, less what does not change the runtime.
CODER_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                     num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                     num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6, rope_theta=10000000.0,
                     max_position_embeddings=262144, tie_word_embeddings=False, use_sliding_window=False)


EXPERT_SCALE = 4.0


def tiny_moe_model(overrides: dict, seed: int) -> Qwen3MoeForCausalLM:
    cfg = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
               num_experts_per_tok=2, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
               tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**cfg, **overrides}))
    # Sharpen the output (greedy text with structure), the routing (clear top-k margins) and the experts (whose outputs
    # then move the residual stream as much as the embedding: which experts a token takes changes the text).
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
        if not model.config.tie_word_embeddings:
            model.lm_head.weight.mul_(8.0)
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
                layer.mlp.experts.gate_up_proj.mul_(EXPERT_SCALE)
                layer.mlp.experts.down_proj.mul_(EXPERT_SCALE)
    return model.eval()


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny-moe")
    paths = {}
    for name, (overrides, seed) in TINY_MOE.items():
        tiny_moe_model(overrides, seed).save_pretrained(root / name)
        paths[name] = str(root / name)
    return paths


@pytest.fixture(params=["cpu", "cpu-kernels", pytest.param("cuda", marks=[pytest.mark.cuda, CUDA])])
def device(request, monkeypatch) -> torch.device:
    """The CPU on torch's ops (as on CUDA), the CPU with our kernels where they run, or the GPU."""
    from adaflash.models.device import placement as process_device

    name = "cpu" if request.param == "cpu-kernels" else request.param
    if request.param != "cpu-kernels":
        monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
    monkeypatch.setenv("ADAFLASH_DEVICE", name)
    monkeypatch.setattr(process_device, "_current", None)
    return torch.device(name)


def _hf(path: str):
    """transformers' model on the CPU, whatever device ours runs on: its experts pick a kernel by device (on a GPU,
    grouped matmuls the fake CUDA device cannot run), and the CPU's fp32 is the reference."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _run(model, ids: list[int], cache, slot: int = 0, start: int = 0, **kw):
    return model(torch.tensor(ids), RaggedBatch.build([slot], [start], [len(ids)]), cache, **kw)


def test_config_reads_the_routing_of_qwen3_coder_30b_a3b():
    cfg = TransformerConfig.from_hf_dict(CODER_30B_A3B)
    assert (cfg.family, cfg.qk_norm, cfg.is_moe) == ("qwen3_moe", True, True)
    assert cfg.moe_layers == tuple(range(48))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (128, 8, 768, True)
    # transformers 5 writes num_local_experts; mlp_only_layers and decoder_sparse_step pick the sparse layers
    other = dict(CODER_30B_A3B, num_local_experts=16, num_hidden_layers=6, mlp_only_layers=[3], decoder_sparse_step=2)
    del other["num_experts"]
    cfg = TransformerConfig.from_hf_dict(other)
    assert cfg.moe_layers == (1, 5) and cfg.num_experts == 16
    assert not TransformerConfig.from_hf_dict(dict(CODER_30B_A3B, num_experts=0)).is_moe


@pytest.mark.parametrize("field,value", [("shared_expert_intermediate_size", 512), ("n_shared_experts", 1),
                                         ("use_sliding_window", True), ("num_experts_per_tok", 200)])
def test_unsupported_moe_variants_fail_at_load_naming_the_field(field, value):
    with pytest.raises(UnsupportedModelError, match=field):
        TransformerConfig.from_hf_dict(dict(CODER_30B_A3B, **{field: value}))


@pytest.mark.parametrize("name", list(TINY_MOE))
def test_logits_and_captured_hidden_states_match_transformers(moe_checkpoints, device, name):
    path = moe_checkpoints[name]
    ids = torch.randint(0, TINY_VOCAB, (20,))
    with torch.no_grad():
        ref = _hf(path)(ids[None], output_hidden_states=True)
    ours = load_target(path, dtype=torch.float32, device=device)
    assert ours.config.is_moe and any(layer.moe is not None for layer in ours.layers)
    out = _run(ours, ids.tolist(), ours.new_cache(1, 32), capture_layers=(2, 0, 1))
    torch.testing.assert_close(out.logits.cpu(), ref.logits[0], atol=1e-4, rtol=1e-4)
    # layer i's output is HF hidden_states[i + 1]; the order follows the request
    expected = torch.cat([ref.hidden_states[3][0], ref.hidden_states[1][0], ref.hidden_states[2][0]], dim=-1)
    torch.testing.assert_close(out.hidden.cpu(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(TINY_MOE))
def test_greedy_equals_transformers(moe_checkpoints, device, name):
    path = moe_checkpoints[name]
    target = load_target(path, dtype=torch.float32, device=device)
    hf = _hf(path)
    for prompt in PROMPTS:
        ours = autoregressive_generate(target, prompt, 24).token_ids
        ids = torch.tensor([prompt])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert ours == theirs


def test_verify_block_over_a_ragged_batch_equals_token_by_token(moe_checkpoints, device):
    """Two sequences verify blocks of 5 and 3 tokens in one pass (the grouped experts): each position's logits and
    captured hidden states are those of decoding it alone, token by token (the gathered experts)."""
    target = load_target(moe_checkpoints["moe"], dtype=torch.float32, device=device)
    prompts, blocks, layers = ([5, 9, 31, 77, 2, 40], [8, 60, 13]), ([11, 12, 13, 14, 15], [70, 71, 72]), (0, 2, 3)
    cache = target.new_cache(3, 32)
    slots = [2, 0]
    for slot, p in zip(slots, prompts):
        _run(target, p, cache, slot=slot)
    batch = RaggedBatch.build(slots, [len(p) for p in prompts], [len(b) for b in blocks])
    verified = target(torch.tensor(sum(blocks, [])), batch, cache, capture_layers=layers)
    offset = 0
    for p, block in zip(prompts, blocks):
        alone = target.new_cache(1, 32)
        _run(target, p, alone)
        for j, token in enumerate(block):
            step = _run(target, [token], alone, start=len(p) + j, capture_layers=layers)
            torch.testing.assert_close(verified.logits[offset + j], step.logits[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(verified.hidden[offset + j], step.hidden[0], atol=1e-5, rtol=1e-5)
        offset += len(block)
    assert [cache.lengths[s] for s in slots] == [11, 6]


def test_static_decode_step_equals_the_ragged_step(moe_checkpoints, device):
    """The one-token step a CUDA graph captures (eager on a CPU) routes and sums the experts as the ragged step does."""
    target = load_target(moe_checkpoints["moe"], dtype=torch.float32, device=device)
    prompt = PROMPTS[0]
    target.static_decode = True
    static = autoregressive_generate(target, prompt, 12).token_ids
    target.static_decode = False
    assert static == autoregressive_generate(target, prompt, 12).token_ids


@pytest.mark.parametrize("draft_length", [3, 7])
def test_speculative_greedy_with_a_random_drafter_is_the_targets_greedy(moe_checkpoints, device, draft_length):
    target = load_target(moe_checkpoints["moe"], dtype=torch.float32, device=device)
    reference = [autoregressive_generate(target, p, 24).token_ids for p in PROMPTS]
    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=8)
    drafter = init_drafter(cfg, seed=0)
    # a draft vocabulary around the target's own continuation, so some random drafts are accepted
    vocab = list(dict.fromkeys(sorted({t for r in reference for t in r})[:12] + [6, 8, 9]))
    drafter.set_draft_vocab(DraftVocab(torch.tensor(vocab, dtype=torch.long), TINY_VOCAB))
    proposer = DFlashProposer(drafter, target)
    for prompt, expected in zip(PROMPTS, reference):
        assert speculative_generate(target, proposer, prompt, 24, draft_length=draft_length).token_ids == expected


def test_checkpoint_and_state_dict_layouts_load_the_same_weights(moe_checkpoints):
    """A checkpoint stores each expert's gate/up/down; transformers 5 holds them fused in memory: both load."""
    path = moe_checkpoints["moe"]
    from_file = load_target(path, dtype=torch.float32, device="cpu")
    hf = _hf(path)
    cfg = TransformerConfig.from_dir(path)
    from_state = target_from_hf_tensors(cfg, hf.state_dict(), torch.float32, "cpu")
    for a, b in zip(from_file.layers, from_state.layers):
        assert (a.moe is None) == (b.moe is None) == (a.gate_up is not None)
        if a.moe is not None:
            for name in ("router", "gate_up", "down"):
                assert torch.equal(getattr(a.moe, name), getattr(b.moe, name))
    # our copy, not a view of transformers' parameters
    assert from_state.layers[0].moe.gate_up.data_ptr() != hf.model.layers[0].mlp.experts.gate_up_proj.data_ptr()
    state = hf.state_dict()
    del state["model.layers.2.mlp.experts.down_proj"]
    with pytest.raises(ValueError, match="expert tensors of MoE layer 2"):
        target_from_hf_tensors(cfg, state, torch.float32, "cpu")


def test_cpu_kernels_pack_the_dense_parts_and_skip_the_fused_layer_step(moe_checkpoints):
    target = load_target(moe_checkpoints["moe"], dtype=torch.float32, device="cpu")
    assert target.layer_steps is None  # the fused per-layer kernel has no experts
    if target.layers[1].fast:  # our kernels run here: attention everywhere, the MLP of the dense layer only
        assert set(target.layers[1].fast) == {"qkv", "o", "gate_up", "down"}
        assert set(target.layers[0].fast) == {"qkv", "o"}
    # a decode step reads 2 of 8 experts a MoE layer (uniform routing), nearly all of them over many rows
    assert target.streamed_weight_bytes(1) < target.streamed_weight_bytes(64)


def test_the_qwen3_coder_30b_a3b_drafter_config_fits_the_target():
    """configs/qwen3-coder-30b-a3b-drafter.toml: a training config whose drafter fits the MoE target's shapes."""
    from pathlib import Path

    from adaflash.models.drafters.config import build_target_layer_ids
    from adaflash.training.trainer import TrainConfig

    cfg = TrainConfig.from_file(Path(__file__).parents[2] / "configs" / "qwen3-coder-30b-a3b-drafter.toml")
    target = TransformerConfig.from_hf_dict(CODER_30B_A3B)
    drafter = DrafterConfig.for_target(target, mask_token_id=cfg.mask_token_id, num_layers=cfg.num_layers,
                                       block_size=cfg.block_size, intermediate_size=cfg.intermediate_size,
                                       target_layer_ids=cfg.target_layer_ids)
    drafter.check_compatible(target)
    assert cfg.target_layer_ids == build_target_layer_ids(48, cfg.num_layers) == (1, 12, 23, 34, 45)
    assert (drafter.hidden_size, drafter.intermediate_size, drafter.num_kv_heads) == (2048, 6144, 4)
    assert not cfg.init_from_target  # a MoE layer has no dense MLP to copy


def test_a_new_drafter_starts_from_a_moe_targets_top_layers(moe_checkpoints):
    """`init_from_target` on a MoE target: attention and norms from the top layers, the MLP of a sparse layer fresh
    (it has no dense MLP), the dense layer's MLP copied."""
    from adaflash.training.trainer import TrainConfig, new_drafter

    target = load_target(moe_checkpoints["moe"], dtype=torch.float32)
    cfg = TrainConfig(data_dir="unused", out_dir="unused", mask_token_id=5, num_layers=3, block_size=8,
                      init_from_target=True)
    drafter = new_drafter(cfg, target)
    first = target.config.num_layers - 3
    for i, layer in enumerate(drafter.layers):
        src = target.layers[first + i]
        assert torch.equal(layer.self_attn.o_proj.weight, src.o)
        inter = target.config.intermediate_size
        copied = torch.equal(layer.mlp.gate_proj.weight, src.gate_up[:inter]) if src.gate_up is not None else None
        assert copied is (True if src.gate_up is not None else None)
    assert any(target.layers[first + i].gate_up is None for i in range(3))
    assert any(target.layers[first + i].gate_up is not None for i in range(3))
