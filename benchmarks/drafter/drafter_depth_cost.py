"""What a drafter's depth costs to draft with on this CPU: the cost-model profile (speculative/cost_model.py) of random
SmolLM2 drafters of 2-5 layers (3 context layers, block 16, the 16K-row draft vocabulary), beside the target's verify
costs. Weights do not change a pass's cost, so random ones stand in for trained ones.

    .venv/bin/python benchmarks/drafter/drafter_depth_cost.py --threads 1 --out docs/results/drafter/depth_cost.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from adaflash.models.drafters.draft_vocab import DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter
from adaflash.models.device.cpu import cpu_model
from adaflash.models.targets.registry import resolve_target
from adaflash.models.targets.model import load_target
from adaflash.report import write_json
from adaflash.speculative.cost_model import profile_cost_model
from adaflash.speculative.proposer import DFlashProposer


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--depths", default="2,3,4,5")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(resolve_target("smollm2-135m"), dtype=torch.float32, device="cpu")
    by_depth = {}
    for depth in (int(d) for d in args.depths.split(",")):
        cfg = DrafterConfig.for_target(target.config, mask_token_id=16, num_layers=depth, block_size=16,
                                       target_layer_ids=(1, 14, 27))
        drafter = init_drafter(cfg, seed=0)
        drafter.set_draft_vocab(DraftVocab(torch.arange(16384), target.config.vocab_size))
        model = profile_cost_model(target, DFlashProposer(drafter, target), max_tokens=16, context=256, repeats=7)
        by_depth[depth] = {"draft_width_s": dict(zip(model.draft_widths, model.draft_width_s)),
                           "verify_1_s": model.verify_s[0], "verify_16_s": model.verify_s[-1]}
        print(depth, by_depth[depth], flush=True)
    report = {"command": " ".join(["python", "benchmarks/drafter/drafter_depth_cost.py", *(argv or sys.argv[1:])]),
              "cpu": cpu_model(), "threads": args.threads, "dtype": "fp32", "context": 256, "by_depth": by_depth}
    write_json(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
