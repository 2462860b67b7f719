"""The real embedded target: conversion, equality with transformers, and lossless speculative decoding."""

from __future__ import annotations

import pytest
import torch

from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.targets.registry import load_tokenizer, resolve_target, transformers_model
from adaflash.models.targets.model import load_target
from adaflash.pipeline import Pipeline

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pipeline(smollm2_dir) -> Pipeline:
    return Pipeline.load(smollm2_dir, dtype="fp32")


def test_conversion_is_cached_and_complete(smollm2_dir):
    assert str(resolve_target("smollm2-135m")) == smollm2_dir  # second resolve reuses the cache
    tok = load_tokenizer(smollm2_dir)
    assert tok.eos_token_id == 2 and tok.convert_ids_to_tokens(16) == "<empty_output>"


def test_fp32_weights_are_the_ggufs_exact_dequantised_values(smollm2_dir, pipeline):
    """gguf's own dequantisation of the file's blocks, bit for bit: a Q4_1 layer (its v rows, which the conversion
    does not reorder, and its down projection) and the Q8_0 embedding."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from adaflash.models.targets.registry import target_gguf

    tensors = {t.name: t for t in GGUFReader(str(target_gguf())).tensors}

    def gguf_weight(name: str) -> torch.Tensor:
        t = tensors[name]
        assert t.tensor_type.name in ("Q4_1", "Q8_0"), t.tensor_type  # blocks, not a float copy
        return torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(*reversed(t.shape.tolist())).copy())

    config = pipeline.target.config
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    layer = pipeline.target.layers[7]
    assert torch.equal(layer.qkv[q + kv:], gguf_weight("blk.7.attn_v.weight"))
    assert torch.equal(layer.down, gguf_weight("blk.7.ffn_down.weight"))
    assert torch.equal(pipeline.target.embed_tokens, gguf_weight("token_embd.weight"))


def test_logits_match_transformers(smollm2_dir, pipeline):
    ids = pipeline.encode(messages=[{"role": "user", "content": "What is the capital of France?"}])
    hf = transformers_model(smollm2_dir)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    target = pipeline.target
    cache = target.new_cache(1, len(ids) + 8)
    ours = target(torch.tensor(ids), RaggedBatch.build([0], [0], [len(ids)]), cache).logits
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=1e-3)
    # One decode step through the cache too.
    nxt = int(ref[-1].argmax())
    with torch.no_grad():
        ref_next = hf(torch.tensor([ids + [nxt]])).logits[0, -1]
    step = target(torch.tensor([nxt]), RaggedBatch.build([0], [len(ids)], [1]), cache).logits[0]
    torch.testing.assert_close(step, ref_next, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("draft_length", [3, 15])
def test_greedy_speculative_equals_ar_on_smollm2(pipeline, draft_length):
    spec_pipeline = pipeline.with_untrained_drafter(num_layers=1, block_size=16, seed=1)
    ids = pipeline.encode(messages=[{"role": "user", "content": "Write a Python function that adds two numbers."}])
    ar = pipeline.generate_ids(ids, "ar", max_new_tokens=24)
    spec = spec_pipeline.generate_ids(ids, "dflash", max_new_tokens=24, draft_length=draft_length)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.draft_tokens >= draft_length


def test_shipped_drafter_loads_and_is_lossless(pipeline):
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.models.targets.registry import shipped_drafter
    from adaflash.speculative.proposer import DFlashProposer

    path = shipped_drafter("smollm2-135m")
    assert path is not None, "the trained SmolLM2 drafter must ship in adaflash/assets/drafters/smollm2-135m"
    drafter = load_drafter(path, dtype=torch.float32)
    assert drafter.config.block_size == 16 and drafter.config.mask_token_id == 16
    spec = Pipeline(pipeline.target, pipeline.tokenizer, DFlashProposer(drafter, pipeline.target), "smollm2-135m")
    ids = pipeline.encode(messages=[{"role": "user", "content": "Natalia sold 48 clips in April and half as many in May. How many in total?"}])
    ar = pipeline.generate_ids(ids, "ar", max_new_tokens=32)
    for length in (4, 15):
        assert spec.generate_ids(ids, "dflash", max_new_tokens=32, draft_length=length).token_ids == ar.token_ids


def test_quantized_kernels_run_the_ggufs_blocks_and_compute_the_same_target(smollm2_dir, pipeline, monkeypatch):
    """Every linear of the embedded target has its GGUF blocks (Q4_1 layers, the Q8_0 tied head), and the quantized
    kernels give bitwise the logits of the fp32 packed kernels: one target, whichever kernel a row count runs."""
    from adaflash.models.kernels.selection import fast_linears_available

    target = pipeline.target
    if not fast_linears_available(target.lm_head):
        pytest.skip("packed kernels unavailable here")
    monkeypatch.setenv("ADAFLASH_KERNELS", "quantized")
    quantized = load_target(smollm2_dir, dtype=torch.float32)
    monkeypatch.setenv("ADAFLASH_KERNELS", "packed")
    packed = load_target(smollm2_dir, dtype=torch.float32)
    assert quantized.lm_head_blocks is not None and quantized.fast_lm_head.choices[0] == "Q8_0"
    assert all(f.choices[0] == "Q4_1" for layer in quantized.layers for f in layer.fast.values())
    ids = pipeline.encode(messages=[{"role": "user", "content": "Name three prime numbers."}])
    outs = []
    for model in (quantized, packed):  # a prompt (blocked path), a 3-token verify and a decode step (few-rows path)
        cache = model.new_cache(1, len(ids) + 4)
        prefill = model(torch.tensor(ids[:-3]), RaggedBatch.build([0], [0], [len(ids) - 3]), cache,
                        logit_indices=torch.tensor([len(ids) - 4])).logits
        verify = model(torch.tensor(ids[-3:]), RaggedBatch.build([0], [len(ids) - 3], [3]), cache).logits
        step = model(torch.tensor([5]), RaggedBatch.build([0], [len(ids)], [1]), cache).logits
        outs.append((prefill, verify, step))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_int8_target_is_one_model_in_every_pass_and_speculation_is_lossless_against_it(smollm2_dir, pipeline):
    """--dtype int8: every GGUF-blocked linear runs with int8-rounded inputs at every row count, the KV cache holds
    fp16. Another model than the fp32 target (close: most argmaxes agree), but one model: a position's logits are
    bitwise the same from a prefill, a verification or a decode step (int8 prefills run the ragged attention kernel
    too), and speculative decoding with the shipped drafter - the reference loop and the engine, its drafter rounded to
    Q8_0 - reproduces its own AR output."""
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.models.kernels.selection import fast_linears_available
    from adaflash.models.targets.registry import shipped_drafter
    from adaflash.speculative.proposer import DFlashProposer

    if not fast_linears_available(pipeline.target.lm_head):
        pytest.skip("our CPU kernels are unavailable here")
    int8 = load_target(smollm2_dir, dtype=torch.float32, int8_activations=True)
    assert int8.int8_activations and int8.fast_lm_head.choices[0] == "Q8_0xint8"
    assert all(f.choices[0] == "Q4_1xint8" and f.kernel_for(4096) is not None
               for layer in int8.layers for f in layer.fast.values())
    assert int8.new_cache(1, 4).k.dtype == torch.float16  # its KV cache, as llama.cpp's
    assert pipeline.target.new_cache(1, 4).k.dtype == pipeline.target.dtype
    ids = pipeline.encode(messages=[{"role": "user", "content": "Name three prime numbers."}])
    n = len(ids)
    whole = int8(torch.tensor(ids), RaggedBatch.build([0], [0], [n]), int8.new_cache(1, n)).logits
    cache = int8.new_cache(1, n)
    int8(torch.tensor(ids[:-4]), RaggedBatch.build([0], [0], [n - 4]), cache)
    verify = int8(torch.tensor(ids[-4:]), RaggedBatch.build([0], [n - 4], [4]), cache).logits
    cache.rollback(0, n - 4)
    steps = torch.stack([int8(torch.tensor([ids[i]]), RaggedBatch.build([0], [i], [1]), cache).logits[0]
                         for i in range(n - 4, n)])
    assert torch.equal(verify, steps) and torch.equal(whole[-4:], steps)
    fp32 = pipeline.target(torch.tensor(ids), RaggedBatch.build([0], [0], [n]), pipeline.target.new_cache(1, n)).logits
    assert not torch.equal(whole, fp32)
    assert (whole.argmax(-1) == fp32.argmax(-1)).float().mean() > 0.9
    proposer = DFlashProposer(load_drafter(shipped_drafter("smollm2-135m"), dtype=torch.float32), int8)
    assert proposer.drafter.fc.fast.choices[0] == "Q8_0xint8"  # beside an int8 target the drafter runs int8 too
    spec = Pipeline(int8, pipeline.tokenizer, proposer, "smollm2-135m")
    prompt = pipeline.encode(messages=[{"role": "user", "content": "Tom has 3 apples and buys 5 more. How many?"}])
    ar = spec.generate_ids(prompt, "ar", max_new_tokens=32)
    for length in (2, 15):
        assert spec.generate_ids(prompt, "dflash", max_new_tokens=32, draft_length=length).token_ids == ar.token_ids
    assert spec.with_length_policy("fixed:3").generate_ids(prompt, "dflash", max_new_tokens=32).token_ids == ar.token_ids


def test_int8_needs_a_gguf_target_with_blocks(tiny_chat_checkpoint):
    with pytest.raises(ValueError, match="--dtype int8 needs"):
        load_target(tiny_chat_checkpoint, dtype=torch.float32, int8_activations=True)


def test_int8_engine_reuses_a_slots_prompt_prefix_exactly(smollm2_dir, pipeline):
    """The int8 target computes every position alone (prefills too run the ragged attention kernel): a position's
    logits are bitwise the same from a prefill or a decode step. So a request landing in a slot that holds part of its
    prompt - here a second turn re-sending the first turn and the model's own answer, which the slot computed in decode
    steps - prefills only the rest, and produces exactly what a fresh engine does, AR and speculative alike (the
    drafter's context cache keeps its prefix too)."""
    from adaflash.engine.engine import Engine
    from adaflash.engine.request import Request
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.models.kernels.selection import fast_linears_available
    from adaflash.models.targets.registry import shipped_drafter
    from adaflash.speculative.proposer import DFlashProposer

    if not fast_linears_available(pipeline.target.lm_head):
        pytest.skip("our CPU kernels are unavailable here")
    int8 = load_target(smollm2_dir, dtype=torch.float32, int8_activations=True)
    assert int8.rows_independent and not pipeline.target.rows_independent  # fp32 prefills on SDPA: no reuse
    ids = pipeline.encode(messages=[{"role": "user", "content": "List three colours."}])
    n = len(ids)
    cache = int8.new_cache(1, n + 8)
    prefill = int8(torch.tensor(ids + ids[:8]), RaggedBatch.build([0], [0], [n + 8]), int8.new_cache(1, n + 8)).logits
    int8(torch.tensor(ids), RaggedBatch.build([0], [0], [n]), cache)
    steps = torch.stack([int8(torch.tensor([t]), RaggedBatch.build([0], [n + i], [1]), cache).logits[0]
                         for i, t in enumerate(ids[:8])])
    assert torch.equal(prefill[-8:], steps)

    def run(engine: Engine, prompt: list[int]) -> list[int]:
        request = Request(f"r{engine.prompt_tokens}", prompt, 24, stop_token_ids=pipeline.stop_token_ids)
        engine.add_request(request)
        while engine.has_work():
            engine.step()
        return request.output_ids

    follow = pipeline.tokenizer.encode("\n<|im_start|>user\nNow three animals.<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
    proposer = DFlashProposer(load_drafter(shipped_drafter("smollm2-135m"), dtype=torch.float32), int8)
    for drafter in (None, proposer):
        engine = Engine(int8, drafter, max_batch=1, max_len=512, kv_block_size=8)  # shared in blocks of 8
        answer = run(engine, ids)
        second = ids + answer + follow
        again = run(engine, second)
        # The slot held the first turn and most of its answer (with a drafter: what its context cache had been fed).
        assert engine.prompt_tokens_reused >= n + len(answer) // 2
        assert again == run(Engine(int8, drafter, max_batch=1, max_len=512), second)


def test_a_request_kept_from_drafting_leaves_its_whole_prefix_for_the_next(smollm2_dir, pipeline):
    """A request the policy kept at zero drafts fed the drafter nothing: its features wait. The next request in its slot
    reuses the whole held prefix all the same (what an AR engine reuses), and when it drafts, the waiting features are
    fed then: its drafts fare exactly as in a fresh engine (the int8 target's features are bitwise those of a fresh
    prefill), and its tokens are the target's."""
    from adaflash.engine.engine import Engine
    from adaflash.engine.request import Request
    from adaflash.models.drafters.checkpoint import load_drafter
    from adaflash.models.kernels.selection import fast_linears_available
    from adaflash.models.targets.registry import shipped_drafter
    from adaflash.speculative.length_policy import FixedLength
    from adaflash.speculative.proposer import DFlashProposer

    if not fast_linears_available(pipeline.target.lm_head):
        pytest.skip("our CPU kernels are unavailable here")
    int8 = load_target(smollm2_dir, dtype=torch.float32, int8_activations=True)
    proposer = DFlashProposer(load_drafter(shipped_drafter("smollm2-135m"), dtype=torch.float32), int8)
    ids = pipeline.encode(messages=[{"role": "user", "content": "Count from one to ten in words."}])

    def run(engine: Engine, prompt: list[int]) -> Request:
        request = Request(f"r{engine.prompt_tokens}", prompt, 24, stop_token_ids=pipeline.stop_token_ids)
        engine.add_request(request)
        while engine.has_work():
            engine.step()
        return request

    engine = Engine(int8, proposer, FixedLength(0), max_batch=1, max_len=512)
    answer = run(engine, ids).output_ids
    follow = pipeline.tokenizer.encode("\n<|im_start|>user\nNow in French.<|im_end|>\n<|im_start|>assistant\n",
                                       add_special_tokens=False)
    second = ids + answer + follow
    engine.policy = FixedLength(3)
    again = run(engine, second)
    held = len(ids) + len(answer) - 1  # every position the slot computed, in whole blocks
    assert engine.prompt_tokens_reused == held // engine.target_cache.block_size * engine.target_cache.block_size
    fresh = run(Engine(int8, proposer, FixedLength(3), max_batch=1, max_len=512), second)
    assert again.output_ids == fresh.output_ids and sum(again.draft_lengths) > 0
    assert again.accept_lengths == fresh.accept_lengths  # the drafter's context is a fresh one's
