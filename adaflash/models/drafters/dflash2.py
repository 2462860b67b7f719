"""DFlash 2's two additions to the drafter ("Keep Drafting Parallel", z-lab / Inco AI, Aug 2026), in the public
checkpoints' parameter names (`layers.N.attention_conv.*`, `layers.N.mlp_conv.*`, `candidate_selector.*`).

- A grouped dynamic causal convolution around each layer's attention and MLP, along the block's positions: position
  t mixes positions t, t-1, ..., t-K+1 of the block (zeros before its start; the context is not convolved), with a
  per-channel base kernel plus a per-group kernel projected from the layer's normed input. `prepare` convolves the
  sublayer's input with the first kernel pair and hands back the second dynamic kernel; `finish` convolves the
  sublayer's output with it. Base kernel [1, 0, ...] and a zero projection make it the identity.
- A candidate selector: the top-K tokens of every drafted position, rescored along the greedy path by
  `unary + <A[predecessor] * P h, B[candidate]>`, so a block reads as one continuation instead of K independent
  guesses. Sampling draws through the softmax over the K candidates (at the request's temperature); that q, zero
  outside the candidates, is the draft law rejection sampling needs, so verification stays lossless.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # (before, after) x taps x channels
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def reset_to_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, B, d] (a layer's normed input over R blocks) -> (x convolved, the kernel `finish` takes)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1])

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """y[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o]: x [R, B, d], dynamic [R, B, K, groups]."""
        r, b, d = x.shape
        grouped = x.view(r, b, self.groups, self.group_size)
        base = base.view(-1, self.groups, self.group_size).to(x.dtype)
        dynamic = dynamic[..., None]  # [R, B, K, groups, 1]
        # (the reference's order of operations: base term, then the dynamic one; a tap past the block's start reads
        # zeros, so it only adds into positions offset..B-1)
        out = torch.addcmul(base[0] * grouped, dynamic[:, :, 0], grouped)
        for offset in range(1, min(self.kernel_size, b)):
            shifted = grouped[:, : b - offset]
            tail = out[:, offset:]
            out = torch.cat([out[:, :offset], torch.addcmul(tail + base[offset] * shifted,
                                                            dynamic[:, offset:, offset], shifted)], dim=1)
        return out.reshape(r, b, d)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.inference_mode()
    def scores(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int,
               ids: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every path score of one request's k drafted positions at once: hidden [k, d] and logits [k, V'] (`ids` maps
        logit columns to target ids: a trimmed draft vocabulary, or None). Returns (candidates [k, K] in target ids,
        the scores of position 0's candidates after the anchor [K], the scores of position p's candidates after each
        candidate of position p - 1 [k-1, K, K]); a path is then a walk through indices, not k rounds of small ops."""
        unary, candidates = torch.topk(logits.float(), min(self.top_k, logits.shape[-1]), dim=-1)
        if ids is not None:
            candidates = ids[candidates]
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()  # [k, rank]
        successors = self.successor_codebook(candidates).float()  # [k, K, rank]
        anchor_query = self.predecessor_codebook.weight[anchor].float() * projected[0]
        first = unary[0] + successors[0] @ anchor_query
        queries = self.predecessor_codebook(candidates[:-1]).float() * projected[1:, None, :]  # [k-1, K, rank]
        return candidates, first, unary[1:, None, :] + queries @ successors[1:].transpose(1, 2)

    @staticmethod
    def greedy_path(first: torch.Tensor, after: torch.Tensor) -> list[int]:
        """The candidate index of each position along the greedy path (one host read)."""
        picks = [int(torch.argmax(first))]
        for best in after.argmax(-1).tolist():  # [k-1][previous] -> index
            picks.append(best[picks[-1]])
        return picks


def selector_law(q: torch.Tensor, candidates: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The selector's draft law over the target's vocabulary: q at the candidates, zero elsewhere -> [k, V]."""
    return q.new_zeros(q.shape[0], vocab_size).scatter_(1, candidates, q)


def codebook_keys(names: Sequence[str]) -> dict[str, str]:
    """Public DFlash 2 checkpoints store the codebooks bare (`candidate_selector.predecessor_codebook`), as the
    reference's loader maps them: saved name -> our parameter name."""
    return {f"candidate_selector.{n}": f"candidate_selector.{n}.weight" for n in names}
