"""The whole-layer step (one kernel call per decoder layer) against the Python layer loop it replaces."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from adaflash.models.kernels import layer_step, packed
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.layers import silu_mul
from adaflash.models.targets.model import load_target

pytestmark = pytest.mark.skipif(packed.library() is None, reason="our CPU kernels cannot run here")


@pytest.mark.parametrize("rows,inter", [(1, 128), (3, 1536), (20, 72), (5, 13)])
def test_silu_mul_matches_torch(rows, inter):
    gate_up = torch.randn(rows, 2 * inter) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, atol=1e-6, rtol=1e-5)


def test_silu_mul_keeps_torchs_kernel_under_autograd():
    """Under autograd our kernel (no backward) must step aside: the gradient is that of silu(gate) * up written out
    from plain ops, for both halves (a detached half would give zeros there)."""
    gate_up = torch.randn(2, 16, generator=torch.Generator().manual_seed(0)) * 3
    ours, ref = gate_up.clone().requires_grad_(), gate_up.clone().requires_grad_()
    weights = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))  # not .sum(): every output weighs apart
    with torch.profiler.profile() as prof:
        (silu_mul(ours) * weights).sum().backward()
    assert not any(e.name == "adaflash::silu_mul" for e in prof.events())
    gate, up = ref[:, :8], ref[:, 8:]
    (gate * torch.sigmoid(gate) * up * weights).sum().backward()
    assert ours.grad[:, :8].abs().min() > 0 and ours.grad[:, 8:].abs().min() > 0
    torch.testing.assert_close(ours.grad, ref.grad, atol=1e-6, rtol=1e-5)


def _spy_on_the_step(monkeypatch, method: str = "forward") -> list[bool | str]:
    """Records, per LayerSteps.forward call (the target's; "run": the drafter's block pass), whether the step ran:
    "logits" where the kernel call computed the logits too, True where only the layers, False where it left them to
    the caller's loop."""
    ran, wrapped = [], getattr(layer_step.LayerSteps, method)

    def spy(self, *args):
        out = wrapped(self, *args)
        ran.append(out is not None and ("logits" if method == "forward" and out[1] is not None else True))
        return out

    monkeypatch.setattr(layer_step.LayerSteps, method, spy)
    return ran


def _steps(model):
    """Prefill (20 tokens: past the step's 16 queries, the loop), a 3-token verify with captures out of layer order
    and logits of two of its rows, a decode step and a ragged batch joining two new sequences with captures in layer
    order (the kernel's own layout, returned as is), and a mixed batch over all three."""
    ids = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(3, 64)
    outs = [model(ids[:20], RaggedBatch.build([0], [0], [20]), cache, capture_layers=(1, 3)),
            model(ids[20:23], RaggedBatch.build([0], [20], [3]), cache, capture_layers=(3, 0),
                  logit_indices=torch.tensor([2, 0])),
            model(ids[23:24], RaggedBatch.build([0], [23], [1]), cache, capture_layers=(0, 2)),
            model(ids[24:30], RaggedBatch.build([2, 1], [0, 0], [2, 4]), cache, capture_layers=(0, 2)),
            model(ids[30:40], RaggedBatch.build([0, 1, 2], [24, 4, 2], [5, 1, 4]), cache)]
    return outs, cache


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])  # qwen2: q/k/v biases; qwen3: q/k norms
def test_the_step_is_bitwise_the_layer_loop(tiny_checkpoints, name, monkeypatch):
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    model = load_target(tiny_checkpoints[name], dtype=torch.float32)
    assert model.layer_steps is not None
    ran = _spy_on_the_step(monkeypatch)
    monkeypatch.setenv("ADAFLASH_LAYER_STEP", "0")
    loop, loop_cache = _steps(model)
    assert ran == [False] * 5
    ran.clear()
    monkeypatch.setenv("ADAFLASH_LAYER_STEP", "1")
    fused, fused_cache = _steps(model)
    assert ran == [False] + ["logits"] * 4  # the 20-token prefill stays on the loop
    for a, b in zip(loop, fused):
        assert torch.equal(a.logits, b.logits)
        assert (a.hidden is None) == (b.hidden is None) and (a.hidden is None or torch.equal(a.hidden, b.hidden))
    for slot in range(loop_cache.num_slots):
        assert all(map(torch.equal, loop_cache.contents(slot), fused_cache.contents(slot)))
    assert loop_cache.lengths == fused_cache.lengths


def test_logit_rows_index_as_torch_does_and_bad_ids_are_index_errors_on_both_paths(tiny_checkpoints, monkeypatch):
    """Negative and repeated logit rows (more rows than tokens: the caller's head) give the loop's bits; a token id
    past the vocabulary or a row past the tokens is an IndexError whether the one-call step or the loop runs."""
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    model = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    ids, batch = torch.tensor([5, 9, 2]), RaggedBatch.build([0], [0], [3])
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("ADAFLASH_LAYER_STEP", flag)
        outs[flag] = [model(ids, batch, model.new_cache(1, 8), logit_indices=rows).logits
                      for rows in (torch.tensor([-1, 0]), torch.tensor([2, 2, 1, 0, 1]))]
        for bad_ids, rows in ((torch.tensor([5, model.config.vocab_size, 2]), None), (ids, torch.tensor([3]))):
            cache = model.new_cache(1, 8)
            with pytest.raises(IndexError):
                model(bad_ids, batch, cache, logit_indices=rows)
            assert cache.lengths == [0]
    assert all(torch.equal(a, b) for a, b in zip(outs["1"], outs["0"]))


def test_the_step_steps_aside_where_a_piece_has_no_kernel(tiny_checkpoints, monkeypatch):
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    model = load_target(tiny_checkpoints["llama"], dtype=torch.float32)
    ids = torch.arange(4)
    fused = model(ids, RaggedBatch.build([0], [0], [4]), model.new_cache(1, 8)).logits
    model.layers[1].down.mul_(2.0)  # in place: that packed copy is stale, so torch's kernel (and the loop) run
    assert model.layer_steps._layers_at(4) is None
    changed = model(ids, RaggedBatch.build([0], [0], [4]), model.new_cache(1, 8)).logits
    model.layers[1].down.mul_(0.5)
    assert not torch.allclose(fused, changed)
    monkeypatch.setenv("ADAFLASH_KERNELS", "stock")
    assert load_target(tiny_checkpoints["llama"], dtype=torch.float32).layer_steps is None


def _tiny_drafter():
    from adaflash.models.drafters.config import DrafterConfig
    from adaflash.models.drafters.checkpoint import init_drafter

    cfg = DrafterConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        vocab_size=96, block_size=8, mask_token_id=3, target_layer_ids=(1, 2), num_target_layers=4,
                        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=512)
    return init_drafter(cfg, seed=1).eval()


@pytest.mark.parametrize("int8", [False, True])
def test_the_drafters_context_feed_is_one_call_and_bitwise_its_loop(monkeypatch, int8):
    """The same kernels in the same order (k and v stacked: each output row its own dot), so the caches are equal
    bit for bit: a prefill past the block-step's 16 rows, a ragged pair, single tokens; fp32 and the int8 kernel."""
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    drafter = _tiny_drafter()
    assert drafter.use_fast_linears(int8_activations=int8)
    features = torch.randn(40, 128, generator=torch.Generator().manual_seed(2))
    ran, run = [], layer_step.ContextStep.run
    monkeypatch.setattr(layer_step.ContextStep, "run", lambda self, *a: ran.append(run(self, *a)) or ran[-1])

    def feed(flag):
        monkeypatch.setenv("ADAFLASH_LAYER_STEP", flag)
        cache = drafter.new_cache(3, 64)
        for batch in (RaggedBatch.build([0], [0], [20]), RaggedBatch.build([2, 1], [0, 0], [3, 5]),
                      RaggedBatch.build([0, 1, 2], [20, 5, 3], [1, 2, 9])):
            drafter.extend_context(cache, features[: batch.num_tokens], batch)
        return cache

    loop, fused = feed("0"), feed("1")
    assert ran == [False] * 3 + [True] * 3
    assert loop.lengths == fused.lengths == [21, 7, 12]
    for slot in range(3):
        assert all(map(torch.equal, loop.contents(slot), fused.contents(slot)))
    with torch.no_grad():
        drafter.fc.weight.mul_(2.0)  # in place: the packed copy is stale, the loop runs on the new values
    assert not drafter._steps_current(drafter._context_step)
    assert not torch.equal(feed("1").contents(0)[0], fused.contents(0)[0])


def test_the_drafters_block_pass_runs_the_step_and_agrees_with_its_loop(monkeypatch):
    """The drafter's step stacks q/k/v and gate/up (an inference copy) and uses the SiLU kernel, so it is close to
    the loop rather than bitwise (drafts need not be exact: verification keeps the output the target's); after an
    in-place change to the weights the loop runs on the new values."""
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    drafter = _tiny_drafter()
    assert drafter.use_fast_linears() and drafter._steps_current(drafter._layer_steps)
    cache = drafter.new_cache(2, 64)
    drafter.extend_context(cache, torch.randn(10, 128), RaggedBatch.build([0, 1], [0, 0], [6, 4]))
    block = torch.randn(2, 8, 64)

    def draft(flag):
        monkeypatch.setenv("ADAFLASH_LAYER_STEP", flag)
        return drafter.draft_hidden(cache, block, [0, 1])

    ran = _spy_on_the_step(monkeypatch, "run")
    torch.testing.assert_close(draft("1"), draft("0"), atol=1e-5, rtol=1e-4)
    assert ran == [True, False]
    with torch.no_grad():
        drafter.layers[0].mlp.down_proj.weight.mul_(3.0)
    assert not drafter._steps_current(drafter._layer_steps)
    torch.testing.assert_close(draft("1"), draft("0"))
