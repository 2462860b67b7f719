"""Prompt sets for evaluating and training speculative decoders (pure Python, no torch).

    from adaflash.data import load_prompts, list_datasets, EVAL_BENCHMARKS, GSMSymbolicStream
    prompts = load_prompts("gsm8k", "eval")            # list[Prompt]
    train = load_prompts("sharegpt-chat", "train", limit=1000)
    fresh = GSMSymbolicStream(seed=0).take(64)          # unlimited math, train templates only

Every set comes from a pip package (see `list_datasets()` for the requirement, or the error a
missing one raises). Splits are deterministic and hash-based (`splits.py`); eval and train never share
an item, and no GSM-Symbolic template of the eval split is used for training or generation.
Parsed large sources are cached under `$ADAFLASH_CACHE/data` (default `~/.cache/adaflash/data`).
"""

from adaflash.data.gsm_symbolic import GSMSymbolicStream
from adaflash.data.jsonl import read_prompts_file
from adaflash.data.prompt import DOMAINS, DatasetUnavailableError, Prompt
from adaflash.data.registry import EVAL_BENCHMARKS, DatasetInfo, dataset_names, list_datasets, load_prompts

__all__ = [
    "DOMAINS",
    "EVAL_BENCHMARKS",
    "DatasetInfo",
    "DatasetUnavailableError",
    "GSMSymbolicStream",
    "Prompt",
    "dataset_names",
    "list_datasets",
    "load_prompts",
    "read_prompts_file",
]
