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
        out = torch.zeros_like(grouped)
        for offset in range(min(self.kernel_size, b)):
            shifted = grouped if offset == 0 else torch.cat([grouped.new_zeros(r, offset, *grouped.shape[2:]),
                                                             grouped[:, : b - offset]], dim=1)
            # (the reference's order of operations: base term, then the dynamic one)
            out = out + base[offset].view(self.groups, self.group_size).to(x.dtype) * shifted
            out = torch.addcmul(out, dynamic[:, :, offset, :, None], shifted)
        return out.view(r, b, d)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.inference_mode()
    def select(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int, ids: torch.Tensor | None,
               temperature: float, generator: torch.Generator | None,
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """One request's drafts along its greedy (or sampled) path.

        hidden [k, d] and logits [k, V'] of the drafted positions; `ids` maps logit columns to target token ids (a
        trimmed draft vocabulary) or None. Returns (tokens [k] in target ids, q [k, K] or None when greedy,
        candidates [k, K] in target ids)."""
        from adaflash.speculative.sampling import sample_tokens  # (speculative sits above models)

        unary, candidates = torch.topk(logits.float(), min(self.top_k, logits.shape[-1]), dim=-1)
        if ids is not None:
            candidates = ids[candidates]
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype)).float()
        successors = self.successor_codebook(candidates).float()  # [k, K, rank]
        predecessor = torch.tensor(anchor, device=logits.device)
        tokens, q_rows = [], []
        for position in range(logits.shape[0]):
            query = self.predecessor_codebook(predecessor).float() * projected[position]
            scores = unary[position] + successors[position] @ query
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = sample_tokens(q[None], generator)[0]
                q_rows.append(q)
            else:
                index = torch.argmax(scores)
            predecessor = candidates[position, index]
            tokens.append(predecessor)
        q = torch.stack(q_rows) if q_rows else None
        return torch.stack(tokens) if tokens else candidates.new_zeros(0), q, candidates


def selector_law(q: torch.Tensor, candidates: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The selector's draft law over the target's vocabulary: q at the candidates, zero elsewhere -> [k, V]."""
    return q.new_zeros(q.shape[0], vocab_size).scatter_(1, candidates, q)


def codebook_keys(names: Sequence[str]) -> dict[str, str]:
    """Public DFlash 2 checkpoints store the codebooks bare (`candidate_selector.predecessor_codebook`), as the
    reference's loader maps them: saved name -> our parameter name."""
    return {f"candidate_selector.{n}": f"candidate_selector.{n}.weight" for n in names}
