"""Tiny random HF models of each family, built offline from configs (no hub)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_VOCAB = 96


def tiny_hf_model(family: str, tie: bool = True, seed: int = 0, vocab: int = TINY_VOCAB, eos: int = 1):
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4 if vocab <= 1024 else 2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
        eos_token_id=eos,
        bos_token_id=0,
    )
    torch.manual_seed(seed)
    base = family.split("-")[0]
    if base == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=10000.0))
    elif base == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=10000.0))
    elif base == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rope_theta=10000.0))
    else:
        raise ValueError(family)
    # Random init is near-uniform; sharpen the output so greedy/sampling tests see real structure.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(8.0)
        if not tie:
            model.lm_head.weight.mul_(8.0)
    return model.eval()


def write_tiny_checkpoint(path: Path, family: str, tie: bool = True, seed: int = 0) -> Path:
    model = tiny_hf_model(family, tie=tie, seed=seed)
    model.save_pretrained(path)
    return path


class ScriptedProposer:
    """A stand-in drafter that proposes a known continuation with seeded corruptions.

    It exercises every accept length (0..k) of the speculative loop, which a random drafter never does.
    `script`: one token sequence (prompt + continuation), or several - one per request of a batch: each draft follows
    the sequence whose token at the anchor's position is the anchor. In sampling mode its distribution is a mixture of
    a point mass on the scripted token and uniform.
    """

    def __init__(self, script, vocab: int, corrupt_prob: float = 0.3, block_size: int = 8, seed: int = 0):
        from adaflash.models.kv_cache.cache import KVCache

        self._cache_type = KVCache
        several = bool(script) and isinstance(script[0], (list, tuple))
        self.scripts = [list(s) for s in script] if several else [list(script)]
        self.vocab, self.corrupt_prob = vocab, corrupt_prob
        self.block_size = block_size
        self.capture_layers = (0,)
        self.rng = torch.Generator().manual_seed(seed)

    def new_cache(self, num_slots: int, max_len: int, **pool):
        return self._cache_type(1, num_slots, max_len, 1, 1, torch.float32, **pool)  # lengths only

    def add_context(self, cache, features, batch) -> None:
        for slot, end in zip(batch.slots, batch.ends):
            cache.lengths[slot] = end

    def _script_at(self, pos: int, anchor: int) -> list[int]:
        return next((s for s in self.scripts if pos < len(s) and s[pos] == anchor), self.scripts[0])

    def _scripted(self, script: list[int], pos: int) -> int:
        tok = script[pos] if pos < len(script) else 0
        if torch.rand(1, generator=self.rng).item() < self.corrupt_prob:
            tok = int(torch.randint(self.vocab, (1,), generator=self.rng))
        return tok

    def propose(self, cache, slots, anchors, num_draft, sampling, generators):
        from adaflash.speculative.proposer import Drafts
        from adaflash.speculative.sampling import sample_tokens

        tokens, probs = [], []
        for slot, anchor, k, params, gen in zip(slots, anchors, num_draft, sampling, generators):
            anchor_pos = int(cache.lengths[slot])
            script = self._script_at(anchor_pos, int(anchor))
            wanted = torch.tensor([self._scripted(script, anchor_pos + 1 + i) for i in range(k)], dtype=torch.long)
            if params.greedy:
                tokens.append(wanted)
                probs.append(None)
            else:
                q = torch.full((k, self.vocab), 0.5 / self.vocab)
                q[torch.arange(k), wanted] += 0.5
                tokens.append(sample_tokens(q, gen))
                probs.append(q)
        return Drafts(tokens=torch.cat(tokens), probs=tuple(probs), num_draft=tuple(num_draft))


def scripted_dflash(target, scripts, corrupt_prob: float = 0.3, block_size: int = 8, seed: int = 0):
    """A real DFlash proposer (a random one-layer drafter: its context, its block hidden states for a learned length
    head, its costs) whose drafts come from `ScriptedProposer(scripts)`: mostly right, so the engine's lossless tests
    see many tokens accepted per pass, with every policy and head in the loop."""
    from adaflash.models.drafters.config import DrafterConfig
    from adaflash.models.drafters.checkpoint import init_drafter
    from adaflash.speculative.proposer import DFlashProposer

    script = ScriptedProposer(scripts, target.config.vocab_size, corrupt_prob, block_size, seed)

    class ScriptedDFlash(DFlashProposer):
        looked: list = []  # (hidden row, slot's cache, slot, anchor) of the blocks the last look ran

        def propose(self, cache, slots, anchors, num_draft, sampling, generators):
            self._check_lengths(num_draft)
            return script.propose(cache, slots, anchors, num_draft, sampling, generators)

        def draft_hidden(self, cache, slots, anchors, width=None):
            hidden = super().draft_hidden(cache, slots, anchors, width)
            self.looked = [(row, cache, slot, anchor) for row, slot, anchor in zip(hidden, slots, anchors)]
            return hidden

        def draft_tokens(self, hidden, num_draft, sampling, generators, anchors=None):
            # Drafting from a learned head's look: each block is known by its hidden states (contexts differ).
            self._check_lengths(num_draft)
            rows = [next(seen for seen in self.looked if torch.equal(seen[0], row)) for row in hidden]
            cache = rows[0][1] if rows else None
            return script.propose(cache, [r[2] for r in rows], [r[3] for r in rows], num_draft, sampling, generators)

    cfg = DrafterConfig.for_target(target.config, mask_token_id=5, num_layers=1, block_size=block_size)
    return ScriptedDFlash(init_drafter(cfg, seed=seed), target)


class PassClock:
    """An injected clock for the engine: virtual seconds that advance only with the target's passes (`base_s`, plus
    `token_s` a token in the pass), so a policy or drafting check that reads a step's cost decides the same way in
    every run, on any machine, however busy. `with clock.driving(target):` times that target's passes."""

    def __init__(self, base_s: float = 0.01, token_s: float = 0.0005) -> None:
        self.base_s, self.token_s, self.now = base_s, token_s, 0.0

    def __call__(self) -> float:
        return self.now

    @contextmanager
    def driving(self, target):
        forward = target.forward

        def timed(token_ids, *args, **kwargs):
            self.now += self.base_s + self.token_s * token_ids.numel()
            return forward(token_ids, *args, **kwargs)

        target.forward = timed
        try:
            yield self
        finally:
            del target.forward


def drafting_happened(requests) -> None:
    """Assert that the drafter's work was verified: some drafts verified and some pass committed more than one token
    (a lossless test that passes while every policy drafts nothing proves nothing)."""
    drafted = sum(k for r in requests for k in r.draft_lengths)
    longest = max((a for r in requests for a in r.accept_lengths), default=0)
    assert drafted > 0 and longest > 1, f"nothing drafted or accepted: {drafted} drafts, longest pass {longest}"


def decode_batches(engine) -> list[int]:
    """Spy on `engine`: the list returned fills with the number of requests of each decode step (proposed for)."""
    sizes, propose = [], engine.drafting.propose

    def spied(requests):
        sizes.append(len(requests))
        return propose(requests)

    engine.drafting.propose = spied
    return sizes


def exact_joint(target, prompt: list[int], params, length: int) -> dict[tuple[int, ...], float]:
    """The target's own law of its first `length` sampled tokens after `prompt`, enumerated over the top-k support."""
    from adaflash.models.kv_cache.ragged import RaggedBatch
    from adaflash.speculative.sampling import logits_to_probs

    joint = {(): 1.0}
    for _ in range(length):
        nxt = {}
        for prefix, mass in joint.items():
            ids = prompt + list(prefix)
            out = target(torch.tensor(ids), RaggedBatch.build([0], [0], [len(ids)]), target.new_cache(1, len(ids)),
                         logit_indices=torch.tensor([len(ids) - 1]))
            p = logits_to_probs(out.logits, params)[0]
            for tok in torch.nonzero(p).flatten().tolist():
                nxt[prefix + (tok,)] = mass * float(p[tok])
        joint = nxt
    return joint


def sampled_counts(target, proposer, prompt: list[int], params, exact: dict, n: int, draft_length: int = 2):
    """Counts of the first len(exact key) sampled tokens over n runs: half through the reference loop (seeds 0..),
    half as requests of one batched engine; returns (counts, the engine's requests)."""
    from adaflash.engine.engine import Engine
    from adaflash.engine.request import Request
    from adaflash.speculative.length_policy import FixedLength
    from adaflash.speculative.reference import speculative_generate

    length = len(next(iter(exact)))
    counts = dict.fromkeys(exact, 0)
    for seed in range(n // 2):
        counts[tuple(speculative_generate(target, proposer, prompt, length, params, draft_length=draft_length,
                                          seed=seed).token_ids)] += 1
    engine = Engine(target, proposer, FixedLength(draft_length), max_batch=16, max_queue=n,
                    max_len=len(prompt) + length + proposer.block_size)
    requests = [Request(f"s{i}", prompt, length, sampling=params, seed=10_000 + i) for i in range(n - n // 2)]
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    for r in requests:
        counts[tuple(r.output_ids)] += 1
    return counts, requests


def law_pvalue(counts: dict[tuple[int, ...], int], exact: dict[tuple[int, ...], float]) -> float:
    """Chi-square p-value of observed sequence counts against the exact law; cells expecting < 5 are pooled so the
    approximation holds."""
    from scipy.stats import chisquare

    n = sum(counts.values())
    big = [k for k in exact if exact[k] * n >= 5]
    observed = [counts.get(k, 0) for k in big] + [n - sum(counts.get(k, 0) for k in big)]
    expected = [exact[k] * n for k in big] + [n * (1 - sum(exact[k] for k in big))]
    return float(chisquare(observed, expected).pvalue)


def held_out_prompts(pipeline, sets, max_tokens: int) -> list:
    """(prompt, its token ids) for the first `count` eval-split prompts of each (name, count) in `sets` whose templated
    ids fit in `max_tokens` (of the first 4 * count): the held-out prompts the peer interop tests share."""
    from adaflash.data import load_prompts

    chosen = []
    for name, count in sets:
        kept = 0
        for prompt in load_prompts(name, "eval", limit=4 * count):
            ids = pipeline.encode(messages=prompt.messages)
            if len(ids) > max_tokens:
                continue
            chosen.append((prompt, ids))
            kept += 1
            if kept == count:
                break
    return chosen


def regenerate_tiny_data(checkpoint: str, out, prompts: list[tuple[str, str]], **config) -> str:
    """`adaflash data generate` on a tiny target into `out`: one sample per (prompt id, domain), the prompt of id
    "x<i>" encoded as [3 + i, 7, 9 + i]; features of layers 1, 2; `config`: the rest of the `DataGenConfig`."""
    from adaflash.data.prompt import Prompt, user_messages
    from adaflash.models.targets.model import load_target
    from adaflash.training.datagen import DataGenConfig, generate_dataset

    target = load_target(checkpoint, dtype=torch.float32)
    generate_dataset(
        target, lambda p: [3 + int(p.id[1:]), 7, 9 + int(p.id[1:])], [],
        [Prompt(id=pid, domain=domain, dataset="t", messages=user_messages(pid)) for pid, domain in prompts], out,
        DataGenConfig(model="tiny", capture_layers=(1, 2), **config),
    )
    return str(out)


def private_cache(path: Path) -> Path:
    """A user cache of a test's own (for ADAFLASH_CACHE): cost models and converted targets start absent there, while
    its kernels/ is the user cache's own folder - the kernel library and the kernel-choice timings, measured once per
    machine rather than once a test (timing the shapes again costs seconds, and a target's kernel choice never changes
    what it computes). Call it before pointing ADAFLASH_CACHE at `path`."""
    from adaflash.models.files import cache_root

    kernels = cache_root() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    path.mkdir(parents=True, exist_ok=True)
    (path / "kernels").symlink_to(kernels.resolve(), target_is_directory=True)
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now (the kernel's pick): what a test's server listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_engine(engine, arrivals: dict, max_steps: int = 500) -> dict[str, list[int]]:
    """Step `engine`, adding the requests of `arrivals[step]` at that step, until it runs empty: each request's tokens."""
    outputs: dict[str, list[int]] = {}
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            engine.add_request(r)
            outputs[r.request_id] = []
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
        if not engine.has_work() and step > max(arrivals):
            break
    return outputs


def engine_law_pvalue(engine, prompt: list[int], params, exact: dict, n: int = 900):
    """`n` seeded sampling requests of `prompt` run together on `engine`: the chi-square p-value of their outputs'
    counts against the `exact` joint law (exact_joint), and the requests (for their accept lengths)."""
    from adaflash.engine.request import Request

    length = len(next(iter(exact)))
    reqs = [Request(f"s{i}", prompt, length, sampling=params, seed=i) for i in range(n)]
    got = run_engine(engine, {0: reqs}, max_steps=10_000)
    counts = dict.fromkeys(exact, 0)
    for toks in got.values():
        counts[tuple(toks)] += 1
    return law_pvalue(counts, exact), reqs
