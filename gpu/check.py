"""The prepared GPU run (`make gpu-check`): what AdaFlash's CUDA path costs at the paper's two targets' shapes (Qwen3-8B
and Qwen3-Coder-30B-A3B), on a bare machine.

No download: a target of each shape with random bf16 weights is built on the GPU (a pass's cost depends on shapes, not
values; a MoE's random router spreads tokens over its experts about uniformly). Written to --out (at most 8 small files,
what the device tool brings back):
- verify_cost.json / verify_cost.md: forward ms for batch {1, 8, 32, 64} x new tokens {1, 2, 4, 8, 16}, every
  sequence at 1K context, and verify-16 / decode at batch 1; Qwen3-8B's, then under "moe" Qwen3-Coder-30B-A3B's (61 GB
  of bf16 weights: left out, saying so, where the device has not the memory for them and the grid's KV cache);
- cost_model.json: the batch-1 profile in the format the throughput length policy reads (speculative/cost_model.py), with
  a random 5-layer block-16 DFlash drafter of Qwen3-8B's shapes for the draft costs (the MoE's, with its drafter of
  configs/qwen3-coder-30b-a3b-drafter.toml's shape, is under "moe" in gpu_check.json);
- under "moe" in gpu_check.json: a small random Qwen3-MoE's greedy tokens in fp32 on the device (CUDA graphs and eager)
  against transformers' on the CPU;
- in gpu_check.json: our AR decode (with its decode steps replayed from CUDA graphs, and eager) against transformers'
  `generate` over the same weights, alternating, medians.
`--tiny` runs the same code at toy shapes in seconds (the CPU dry run `make test` holds).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo's package, not installed on the GPU machine

from adaflash.models.targets.config import TransformerConfig  # noqa: E402
from adaflash.models.device.memory import free_memory
from adaflash.models.device.placement import describe, synchronize, use_device  # noqa: E402
from adaflash.models.drafters.config import DrafterConfig  # noqa: E402
from adaflash.models.drafters.checkpoint import init_drafter  # noqa: E402
from adaflash.models.kv_cache.ragged import RaggedBatch  # noqa: E402
from adaflash.models.targets.model import TargetModel, random_target, target_from_hf_tensors  # noqa: E402
from adaflash.speculative.cost_model import measure_step_table  # noqa: E402
from adaflash.speculative.cost_model import profile_cost_model  # noqa: E402
from adaflash.speculative.proposer import DFlashProposer  # noqa: E402

# Qwen3-8B's config.json, less what does not change a pass's cost.
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                rope_theta=1000000.0, tie_word_embeddings=False, max_position_embeddings=40960, eos_token_id=151645)
TINY = dict(QWEN3_8B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, eos_token_id=1)
# Qwen3-Coder-30B-A3B's config.json (the paper's second target, Qwen3-MoE), less what does not change a pass's cost.
QWEN3_CODER_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=151936, hidden_size=2048,
                           intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                           norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6,
                           rope_theta=10000000.0, tie_word_embeddings=False, max_position_embeddings=262144,
                           eos_token_id=151645)
TINY_MOE = dict(QWEN3_CODER_30B_A3B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, max_position_embeddings=512, eos_token_id=1)
FULL_GRID = dict(batches=(1, 8, 32, 64), new_tokens=(1, 2, 4, 8, 16), context=1024, decode_tokens=128, repeats=10)
TINY_GRID = dict(batches=(1, 2), new_tokens=(1, 2, 4), context=32, decode_tokens=8, repeats=2)
QWEN3_MASK_ID = 151669  # DFlash's mask row for Qwen3 (an unused row of the padded embedding)


def verify_cost_table(target, device: torch.device, grid: dict) -> dict:
    """Forward ms of every (batch, new tokens) cell with each sequence at the grid's context (`measure_step_table`)."""
    return measure_step_table(target, grid["batches"], grid["new_tokens"], (grid["context"],), grid["repeats"])


def ar_against_transformers(hf_config: dict, device: torch.device, dtype: torch.dtype, grid: dict) -> dict:
    """Batch-1 greedy decoding of `decode_tokens` after a `context`-token prompt: our reference AR loop (decode steps
    from CUDA graphs where the device has them, and eager) and transformers' generate over the same random weights,
    alternating three rounds; medians and token agreement."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in hf_config.items() if k != "architectures"}))
    finally:
        torch.set_default_dtype(previous)
    hf = hf.eval()
    ours = target_from_hf_tensors(TransformerConfig.from_hf_dict(hf_config), hf.state_dict(), dtype, device)
    prompt = torch.randint(100, hf_config["vocab_size"], (grid["context"],), generator=torch.Generator().manual_seed(0))
    n = grid["decode_tokens"]
    ids = prompt[None].to(device)

    context = grid["context"]
    cache = ours.new_cache(1, context + n)  # one cache for every run: its decode graphs are captured once (warm-up)

    def run_ours(static: bool | None = None) -> list[int]:
        """Greedy AR over the kept cache (a fresh cache a run would time its graphs' capture too)."""
        ours.static_decode = static  # None: the default (graphs on CUDA)
        cache.rollback(0, 0)
        out = ours(prompt.to(device), RaggedBatch.build([0], [0], [context]), cache,
                   logit_indices=torch.tensor([context - 1]))
        tokens = [int(out.logits[0].argmax())]
        while len(tokens) < n:
            out = ours(torch.tensor(tokens[-1:], device=device), RaggedBatch.build([0], [context + len(tokens) - 1],
                                                                                   [1]), cache)
            tokens.append(int(out.logits[0].argmax()))
        return tokens

    def run_hf() -> list[int]:
        with torch.inference_mode():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0)
        return out[0, ids.shape[1]:].tolist()

    runs = {"ours": run_ours, "ours_eager": lambda: run_ours(False), "transformers": run_hf}
    times: dict[str, list[float]] = {name: [] for name in runs}
    tokens = {}
    for run in runs.values():  # warm-up: kernels, allocator, caches
        run()
    for _ in range(3):
        for name, run in runs.items():
            synchronize(device)
            start = time.perf_counter()
            tokens[name] = run()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    agree = next((i for i, (a, b) in enumerate(zip(tokens["ours"], tokens["transformers"])) if a != b), n)
    med = {k: statistics.median(v) for k, v in times.items()}
    del hf
    return {"prompt_tokens": grid["context"], "new_tokens": n, "seconds": med,
            "tokens_per_s": {k: n / v for k, v in med.items()}, "ours_speedup": med["transformers"] / med["ours"],
            "ours_eager_speedup": med["transformers"] / med["ours_eager"], "greedy_tokens_agree_first": agree,
            "graphs_agree_with_eager": tokens["ours"] == tokens["ours_eager"],
            "graphs_vs_eager": first_parting(ours, prompt.tolist(), tokens["ours"], tokens["ours_eager"], device)}


def first_parting(target, prompt: list[int], a: list[int], b: list[int], device: torch.device) -> dict:
    """Where two greedy decodings of the same weights first part, and the eager top-two logit gap there: random bf16
    weights have near-ties, where a graph's and an eager step's roundings may pick differently (a gap within bf16's
    rounding says a near-tie, not a defect)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if i is None:
        return {"same_tokens": True, "first_difference": None}
    ids = prompt + a[:i]
    target.static_decode = False
    with torch.inference_mode():
        out = target(torch.tensor(ids, device=device), RaggedBatch.build([0], [0], [len(ids)]),
                     target.new_cache(1, len(ids)), logit_indices=torch.tensor([len(ids) - 1]))
    target.static_decode = None
    row = out.logits[0].float()
    gap = float(row[a[i]] - row[b[i]])
    return {"same_tokens": False, "first_difference": i, "logit_gap": gap,
            "near_tie": abs(gap) <= 0.125 * max(1.0, float(row.abs().max()) / 8)}


def weight_and_cache_bytes(cfg: TransformerConfig, grid: dict, dtype: torch.dtype) -> int:
    """What a target of `cfg` and verify_cost_table's KV cache take on the device (before activations)."""
    with torch.device("meta"):
        params = sum(p.numel() for p in TargetModel(cfg).parameters())
    slots, positions = max(grid["batches"]), grid["context"] + max(grid["new_tokens"])
    kv = 2 * cfg.num_layers * slots * cfg.num_kv_heads * positions * cfg.head_dim
    return (params + kv) * dtype.itemsize


def moe_cost(hf_config: dict, device: torch.device, dtype: torch.dtype, grid: dict) -> dict:
    """The verify-cost table and the batch-1 cost profile of a MoE target of `hf_config`'s shapes, or why it was left
    out (its weights and the grid's KV cache do not fit the device's free memory, with 4 GiB for activations)."""
    cfg = TransformerConfig.from_hf_dict(hf_config)
    needed, free = weight_and_cache_bytes(cfg, grid, dtype) + (4 << 30), free_memory(device)
    report = {"experts": cfg.num_experts, "experts_per_token": cfg.num_experts_per_tok, "needed_bytes": needed,
              "free_bytes": free}
    if free is not None and needed > free:
        report["skipped"] = f"needs {needed / 2**30:.1f} GiB, {device} has {free / 2**30:.1f} GiB free"
        return report
    target = random_target(cfg, dtype, device)
    report["verify_cost"] = verify_cost_table(target, device, grid)
    report["cost_model"] = drafter_cost_model(target, device, grid)
    return report


def moe_greedy_against_transformers(device: torch.device, new_tokens: int = 32) -> dict:
    """A small random Qwen3-MoE in fp32 (4 layers, one of them dense, 16 experts, 4 a token): our greedy decoding on the
    device (decode steps from CUDA graphs where the device has them, and eager) against transformers' on the CPU (its
    experts pick their kernel by device; the CPU's fp32 is the reference). Token-identical in fp32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from adaflash.speculative.reference import autoregressive_generate

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=1024, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=4,
        norm_topk_prob=True, mlp_only_layers=[2], max_position_embeddings=512, rope_theta=10000.0)).eval()
    with torch.no_grad():  # clear routing margins and outputs that depend on the experts taken
        hf.model.embed_tokens.weight.mul_(8.0)
        hf.lm_head.weight.mul_(8.0)
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0.0, 0.5)
                layer.mlp.experts.gate_up_proj.mul_(4.0)
                layer.mlp.experts.down_proj.mul_(4.0)
    cfg = TransformerConfig.from_hf_dict({**hf.config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    ours = target_from_hf_tensors(cfg, hf.state_dict(), torch.float32, device)
    prompt = torch.randint(0, 1024, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    graphs = autoregressive_generate(ours, prompt, new_tokens).token_ids
    ours.static_decode = False
    eager = autoregressive_generate(ours, prompt, new_tokens).token_ids
    first = lambda a: next((i for i, (x, y) in enumerate(zip(a, theirs)) if x != y), new_tokens)  # noqa: E731
    return {"new_tokens": new_tokens, "agree_first": first(graphs), "eager_agree_first": first(eager),
            "distinct_tokens": len(set(theirs))}


def drafter_cost_model(target, device: torch.device, grid: dict) -> dict:
    """The batch-1 cost profile the throughput policy reads, with a random 5-layer, block-16 drafter of these shapes."""
    cfg = DrafterConfig.for_target(target.config, mask_token_id=min(QWEN3_MASK_ID, target.config.vocab_size - 1),
                                   num_layers=5, block_size=16)
    proposer = DFlashProposer(init_drafter(cfg, seed=0, dtype=target.dtype), target)
    model = profile_cost_model(target, proposer, max_tokens=16, context=grid["context"], repeats=grid["repeats"])
    return json.loads(model.to_json())


def cost_table(table: dict) -> list[str]:
    batches = sorted({c["batch"] for c in table["cells"]})
    widths = sorted({c["new_tokens"] for c in table["cells"]})
    ms = {(c["batch"], c["new_tokens"]): c["ms"] for c in table["cells"]}
    lines = ["| batch \\ new tokens | " + " | ".join(str(w) for w in widths) + " |", "|---" * (len(widths) + 1) + "|"]
    lines += [f"| {b} | " + " | ".join(f"{ms[b, w]:.2f}" for w in widths) + " |" for b in batches]
    return lines + ["", f"verify-{widths[-1]} / decode at batch 1: **{table['verify16_over_decode_batch1']:.2f}x**"]


def markdown(report: dict) -> str:
    table = report["verify_cost"]
    lines = [f"# Verify cost at Qwen3-8B's shapes ({report['shapes']})", "",
             f"{report['machine']['device_name']}, torch {report['machine']['torch']}, {report['dtype']}, random weights, "
             f"every sequence at {table['context']} cached positions; median ms of a forward pass (logits for every "
             f"new row). Command: `{report['command']}`.", ""] + cost_table(table)
    moe = report.get("moe")
    if moe:
        lines += ["", f"## Qwen3-Coder-30B-A3B's shapes ({moe['shapes']}: {moe['experts']} experts, "
                  f"{moe['experts_per_token']} a token; the experts on torch's ops: grouped by expert, gathered on the "
                  "device in a one-token step)", ""]
        lines += [f"Left out: {moe['skipped']}."] if "skipped" in moe else cost_table(moe["verify_cost"])
        greedy = moe["greedy_vs_transformers"]
        lines += ["", f"A small random Qwen3-MoE in fp32: our greedy tokens agree with transformers' for the first "
                  f"{greedy['agree_first']} of {greedy['new_tokens']} (graphs), {greedy['eager_agree_first']} (eager)."]
    ar = report.get("ar_vs_transformers")
    if ar:
        lines += ["", f"AR decode, batch 1, {ar['prompt_tokens']}-token prompt + {ar['new_tokens']} tokens (3 alternating "
                  f"rounds, medians): ours {ar['tokens_per_s']['ours']:.1f} tok/s (eager "
                  f"{ar['tokens_per_s']['ours_eager']:.1f}), transformers' generate "
                  f"{ar['tokens_per_s']['transformers']:.1f} tok/s: **{ar['ours_speedup']:.2f}x** (eager "
                  f"{ar['ours_eager_speedup']:.2f}x); greedy tokens agree with transformers' for the first "
                  f"{ar['greedy_tokens_agree_first']} of {ar['new_tokens']}; graphs and eager give the same tokens: "
                  f"{ar['graphs_agree_with_eager']}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the dry run)")
    p.add_argument("--tiny", action="store_true", help="toy shapes and a small grid: the dry run, seconds")
    p.add_argument("--out", required=True, help="folder for the result files")
    p.add_argument("--skip-transformers", action="store_true", help="leave out the transformers comparison")
    p.add_argument("--skip-moe", action="store_true", help="leave out Qwen3-Coder-30B-A3B's shapes")
    args = p.parse_args(argv)
    device = use_device(args.device)
    if args.tiny:
        torch.set_num_threads(1)  # toy shapes gain nothing from threads, and a busy core stalls OpenMP's waits
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_config, grid = (TINY, TINY_GRID) if args.tiny else (QWEN3_8B, FULL_GRID)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"command": " ".join(["python", "gpu/check.py", *(argv if argv is not None else sys.argv[1:])]),
              "shapes": "tiny" if args.tiny else "Qwen3-8B", "dtype": str(dtype).removeprefix("torch."),
              "machine": {"device_name": describe(device), "torch": torch.__version__, "python": platform.python_version(),
                          "cuda": torch.version.cuda}}
    started = time.perf_counter()
    target = random_target(TransformerConfig.from_hf_dict(hf_config), dtype, device)
    report["verify_cost"] = verify_cost_table(target, device, grid)
    (out / "verify_cost.json").write_text(json.dumps(report, indent=2) + "\n")
    report["cost_model"] = drafter_cost_model(target, device, grid)
    (out / "cost_model.json").write_text(json.dumps(report["cost_model"]) + "\n")
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if not args.skip_moe:
        report["moe"] = {"shapes": "tiny" if args.tiny else "Qwen3-Coder-30B-A3B",
                         **moe_cost(TINY_MOE if args.tiny else QWEN3_CODER_30B_A3B, device, dtype, grid),
                         "greedy_vs_transformers": moe_greedy_against_transformers(device, 8 if args.tiny else 32)}
        (out / "verify_cost.json").write_text(json.dumps(report, indent=2) + "\n")
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.skip_transformers:
        report["ar_vs_transformers"] = ar_against_transformers(hf_config, device, dtype, grid)
    report["elapsed_s"] = time.perf_counter() - started
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "verify_cost.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
