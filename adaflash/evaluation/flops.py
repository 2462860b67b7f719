"""What a benchmark's tokens cost in matmul FLOPs, and this machine's matmul peak to compare them with.

Batched serving is judged by its achieved FLOP/s as a fraction of the measured matmul peak: the linears' FLOPs of
the tokens served (2 per weight a token meets), over the wall time, against a large fp32 GEMM timed on the same cores
in the same run. Attention's FLOPs are left out (a few percent at these contexts).
"""

from __future__ import annotations

import statistics
import time

import torch

from adaflash.models.targets.config import TransformerConfig


def matmul_peak_flops(dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 3) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on torch's threads (one warm-up, then the mean of `repeats`)."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def matmul_peak_gflops(samples: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """The median of several peak measurements, in GFLOP/s (one sample can fall on a slow stretch of a VM)."""
    return statistics.median(matmul_peak_flops(dtype) for _ in range(samples)) / 1e9


def linear_flops_per_token(config: TransformerConfig, with_head: bool = True) -> int:
    """Matmul FLOPs one token costs in the decoder's linears (q/k/v, o, gate/up, down of every layer) and, with
    `with_head`, the LM head. A prompt token needs no LM head (only a prompt's last position does)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    per_layer = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    head = c.hidden_size * c.vocab_size if with_head else 0
    return 2 * (c.num_layers * per_layer + head)


def served_gflops(config: TransformerConfig, output_tokens_per_s: float, prompt_tokens_per_output_token: float) -> dict:
    """GFLOP/s of a served load: its output tokens alone (each a full forward with the head), and with the prompt
    tokens it prefilled (without the head): the first is the usual yardstick, the second the work the server did."""
    out = output_tokens_per_s * linear_flops_per_token(config) / 1e9
    prompt_tokens_per_s = output_tokens_per_s * prompt_tokens_per_output_token
    prompts = prompt_tokens_per_s * linear_flops_per_token(config, with_head=False) / 1e9
    return {"output_gflops": out, "with_prompts_gflops": out + prompts}
