"""The DFlash drafter: semantics against a dense re-derivation, caching, and the public checkpoint schema."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig, build_target_layer_ids
from adaflash.models.drafters.checkpoint import deepen_drafter, init_drafter, load_drafter, save_drafter
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.layers import apply_rope, rope_cos_sin

TARGET = TransformerConfig(
    family="qwen3", vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=6, num_heads=4,
    num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
    qkv_bias=False, o_bias=False, qk_norm=True, max_position_embeddings=512,
)


def _drafter(num_layers=2, block=4, seed=0):
    cfg = DrafterConfig.for_target(TARGET, mask_token_id=7, num_layers=num_layers, block_size=block)
    return init_drafter(cfg, seed=seed, dtype=torch.float32)


def _dense_reference(drafter, context_features, block_embeds):
    """Straight from the paper: K/V from [context ; block], Q from block, no mask, RoPE at true positions."""
    cfg = drafter.config
    c, b = context_features.shape[0], block_embeds.shape[0]
    ctx = drafter.hidden_norm(drafter.fc(context_features))
    pos = torch.arange(c + b)
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, torch.float32)
    h = block_embeds
    for layer in drafter.layers:
        a = layer.self_attn
        x = layer.input_layernorm(h)
        kv_in = torch.cat([ctx, x])
        k = apply_rope(a.k_norm(a.k_proj(kv_in).view(c + b, cfg.num_kv_heads, -1)), cos, sin)
        v = a.v_proj(kv_in).view(c + b, cfg.num_kv_heads, -1)
        q = apply_rope(a.q_norm(a.q_proj(x).view(b, cfg.num_heads, -1)), cos[c:], sin[c:])
        rep = cfg.num_heads // cfg.num_kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        att = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        h = h + a.o_proj(att.transpose(0, 1).reshape(b, -1))
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return drafter.norm(h)


def test_layer_ids_follow_dflash():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B, as published
    assert build_target_layer_ids(36, 1) == (18,)
    assert build_target_layer_ids(30, 2) == (1, 27)


@pytest.mark.parametrize("fast", [False, True])
def test_cached_drafting_equals_dense_reference(fast, monkeypatch):
    """Also with the drafter's projections on our kernels (inference only: the reference runs with autograd on,
    through torch's kernel)."""
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    drafter = _drafter()
    if fast and not drafter.use_fast_linears():
        pytest.skip("packed kernels unavailable here")
    n_ctx, b = 9, drafter.config.block_size
    feats = torch.randn(n_ctx, 2 * 64)
    block = torch.randn(b, 64)
    expected = _dense_reference(drafter, feats, block)
    cache = drafter.new_cache(2, 32)
    # Context arrives in two chunks (prefill, then accepted tokens), in slot 1.
    drafter.extend_context(cache, feats[:5], RaggedBatch.build([1], [0], [5]))
    drafter.extend_context(cache, feats[5:], RaggedBatch.build([1], [5], [4]))
    got = drafter.draft_hidden(cache, block[None], [1])[0]
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    # Drafting leaves the context untouched: a second pass gives the same answer.
    assert cache.lengths[1] == n_ctx
    torch.testing.assert_close(drafter.draft_hidden(cache, block[None], [1])[0], expected, atol=1e-5, rtol=1e-5)


def test_a_bf16_saved_drafter_drafts_bitwise_the_same_on_the_bf16_kernel(monkeypatch):
    """Weights with bf16 values (how checkpoints are saved) run the BF16 kernel: context feed and block pass give the
    fp32 kernel's results bit for bit."""
    def run(mode):
        monkeypatch.setenv("ADAFLASH_KERNELS", mode)
        drafter = _drafter()
        with torch.no_grad():
            for p in drafter.parameters():
                p.copy_(p.to(torch.bfloat16).float())
        if not drafter.use_fast_linears():
            pytest.skip("packed kernels unavailable here")
        formats = {getattr(f.kernel_for(1), "fmt", "fp32") for m in drafter.modules() if (f := getattr(m, "fast", None))}
        cache = drafter.new_cache(1, 32)
        g = torch.Generator().manual_seed(3)
        drafter.extend_context(cache, torch.randn(6, 128, generator=g), RaggedBatch.build([0], [0], [6]))
        return formats, drafter.draft_hidden(cache, torch.randn(1, drafter.config.block_size, 64, generator=g), [0])

    bf16_formats, bf16 = run("quantized")  # forced: the BF16 kernel wherever a weight has BF16 blocks
    fp32_formats, fp32 = run("packed")
    assert bf16_formats == {"BF16"} and fp32_formats == {"fp32"}
    assert torch.equal(bf16, fp32)


def test_batched_drafting_with_ragged_contexts():
    drafter = _drafter()
    b = drafter.config.block_size
    lens, slots = [3, 8], [2, 0]
    feats = [torch.randn(n, 128) for n in lens]
    blocks = torch.randn(2, b, 64)
    cache = drafter.new_cache(3, 32)
    drafter.extend_context(cache, torch.cat(feats), RaggedBatch.build(slots, [0, 0], lens))
    got = drafter.draft_hidden(cache, blocks, slots)
    for i in range(2):
        torch.testing.assert_close(got[i], _dense_reference(drafter, feats[i], blocks[i]), atol=1e-5, rtol=1e-5)


PUBLIC_LAYER_KEYS = {
    "input_layernorm.weight", "post_attention_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.q_proj.weight", "self_attn.v_proj.weight",
}


def test_checkpoint_schema_and_round_trip(tmp_path):
    drafter = _drafter(num_layers=2)
    save_drafter(drafter, tmp_path / "d")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["block_size"] == 4 and config["num_target_layers"] == 6
    assert config["dflash_config"]["mask_token_id"] == 7
    assert config["dflash_config"]["target_layer_ids"] == [1, 3]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "d" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in keys)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{k}" for i in range(2) for k in PUBLIC_LAYER_KEYS
    }
    assert keys == expected  # no embedding, no LM head: the target's are shared
    loaded = load_drafter(tmp_path / "d", dtype=torch.float32)
    for (name, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(a.to(torch.bfloat16).float(), b, msg=name)
    # Unknown keys of a public config survive a load/save round trip.
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    config["dflash_config"]["thresh_head_hidden"] = 256
    (tmp_path / "d" / "config.json").write_text(json.dumps(config))
    again = save_drafter(load_drafter(tmp_path / "d"), tmp_path / "e")
    round_tripped = json.loads((again / "config.json").read_text())
    assert round_tripped["auto_map"] == config["auto_map"]
    assert round_tripped["dflash_config"]["thresh_head_hidden"] == 256


def test_public_style_checkpoint_loads(tmp_path):
    """A config written the way z-lab publishes them (Qwen3 keys, no rope_parameters) loads here."""
    public = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "vocab_size": 96, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "block_size": 4, "num_target_layers": 6,
        "dflash_config": {"mask_token_id": 5}, "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    }
    cfg = DrafterConfig.from_hf_dict(public)
    assert cfg.target_layer_ids == (3,) and cfg.rope_theta == 1e6
    save_drafter(init_drafter(cfg), tmp_path)
    assert load_drafter(tmp_path).config.mask_token_id == 5


def test_bad_checkpoints_name_the_file(tmp_path):
    save_drafter(_drafter(), tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_drafter(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="DFlashDraftModel"):
        load_drafter(tmp_path)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_drafter(tmp_path / "missing")
    other = tmp_path / "other"
    save_drafter(_drafter(num_layers=1), other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"], cfg["layer_types"] = 2, ["full_attention"] * 2
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_drafter(other)


def test_drafter_must_fit_target():
    cfg = DrafterConfig.for_target(TARGET, mask_token_id=7)
    other = TransformerConfig(**{**TARGET.__dict__, "num_layers": 12})
    with pytest.raises(ValueError, match="num_target_layers"):
        cfg.check_compatible(other)


def test_training_forward_equals_cached_inference():
    """Every anchor's block in the one-pass training forward equals drafting at that point at inference."""
    drafter = _drafter(num_layers=2, block=4)
    seq_len, b = 14, 4
    feats = torch.randn(seq_len, 128)
    anchors = torch.tensor([3, 7, 10, 1])
    blocks = torch.randn(len(anchors), b, 64)
    train = drafter.forward_train(feats, blocks, anchors)
    for j, anchor in enumerate(anchors.tolist()):
        cache = drafter.new_cache(1, 32)
        drafter.extend_context(cache, feats[:anchor], RaggedBatch.build([0], [0], [anchor]))
        infer = drafter.draft_hidden(cache, blocks[j : j + 1], [0])[0]
        torch.testing.assert_close(train[j], infer, atol=1e-5, rtol=1e-5)
    # Differentiable end to end, with the dense re-derivation's gradients: each block's weighted loss, summed, back
    # through every weight and both inputs (weighted, so every output's gradient counts apart).
    weights = torch.randn(train.shape, generator=torch.Generator().manual_seed(1))
    feats.requires_grad_(), blocks.requires_grad_()
    (drafter.forward_train(feats, blocks, anchors) * weights).sum().backward()
    ours = {"feats": feats.grad, "blocks": blocks.grad, **{n: p.grad for n, p in drafter.named_parameters()}}
    drafter.zero_grad(set_to_none=True)
    feats.grad = blocks.grad = None
    sum((_dense_reference(drafter, feats[:anchor], blocks[j]) * weights[j]).sum()
        for j, anchor in enumerate(anchors.tolist())).backward()
    ref = {"feats": feats.grad, "blocks": blocks.grad, **{n: p.grad for n, p in drafter.named_parameters()}}
    assert set(ours) == set(ref) and all(g is not None and g.abs().sum() > 0 for g in ours.values())
    for name, g in ours.items():
        torch.testing.assert_close(g, ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_training_attention_is_4d_and_equals_the_3d_formulation(monkeypatch):
    """The training pass calls SDPA with [batch, heads, q, k] tensors and a mask broadcast over batch and heads (what
    CUDA's memory-efficient kernel takes; 3-D falls back to the math kernel), and gets what the former 3-D call got."""
    from adaflash.models.drafters import dflash as drafter_module

    sdpa, calls = F.scaled_dot_product_attention, []

    def checked(q, k, v, attn_mask=None, **kw):
        assert q.dim() == k.dim() == v.dim() == 4 and q.shape[0] == 1 and attn_mask.shape[:2] == (1, 1)
        out = sdpa(q, k, v, attn_mask=attn_mask, **kw)
        torch.testing.assert_close(out[0], sdpa(q[0], k[0], v[0], attn_mask=attn_mask[0], **kw), atol=1e-6, rtol=1e-6)
        calls.append(q.shape)
        return out

    monkeypatch.setattr(drafter_module.F, "scaled_dot_product_attention", checked)
    drafter = _drafter(num_layers=2, block=4)
    drafter.forward_train(torch.randn(14, 128), torch.randn(3, 4, 64), torch.tensor([3, 7, 10])).sum().backward()
    assert len(calls) == 2 and calls[0] == (1, 4, 12, 16)


def test_a_deepened_drafter_first_drafts_as_the_one_it_grew_from():
    """Appended layers start as the identity on the residual stream; the trained layers are kept as they were."""
    shallow = _drafter(num_layers=2, block=4, seed=3)
    deep = deepen_drafter(shallow, 4, seed=1)
    assert deep.config.num_layers == 4 and len(deep.layers) == 4
    feats, blocks, anchors = torch.randn(14, 128), torch.randn(3, 4, 64), torch.tensor([3, 7, 10])
    with torch.no_grad():
        torch.testing.assert_close(deep.forward_train(feats, blocks, anchors),
                                   shallow.forward_train(feats, blocks, anchors), atol=1e-6, rtol=1e-6)
    for name, value in shallow.state_dict().items():
        torch.testing.assert_close(deep.state_dict()[name], value, atol=0, rtol=0, msg=name)
    # The new layers are not dead: their input projections are initialised, so gradients reach them.
    deep.forward_train(feats, blocks, anchors).sum().backward()
    assert deep.layers[3].self_attn.o_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="shallower"):
        deepen_drafter(deep, 2)


def test_sharded_checkpoint_round_trip(tmp_path):
    """Weights over max_shard_bytes go into HF-style shards + index (what leaves a machine in bounded files); they
    load as one file does, and a later unsharded save leaves no stale shard behind."""
    cfg = DrafterConfig.for_target(TARGET, mask_token_id=5, num_layers=2, block_size=4)
    drafter = init_drafter(cfg, seed=0)
    save_drafter(drafter, tmp_path, dtype=torch.float32, max_shard_bytes=40_000)
    shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    loaded = load_drafter(tmp_path, dtype=torch.float32)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())
    save_drafter(drafter, tmp_path, dtype=torch.float32)
    assert not list(tmp_path.glob("model-*-of-*.safetensors")) and (tmp_path / "model.safetensors").is_file()
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(tmp_path)
