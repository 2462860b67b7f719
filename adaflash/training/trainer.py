"""The one drafter training loop: DFlash block training with a pluggable loss strategy.

Runs on the process's device (`--device`: the target frozen in bf16 on CUDA, the drafter's fp32 weights trained under
bf16 autocast there), alone or under `torchrun` (DDP; gloo on CPU, nccl with one GPU per rank). Deterministic data order and anchors
(seeded by epoch and sample index) plus checkpoints holding weights, optimizer, scheduler and step make a
killed run resume exactly where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
import tomllib
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from adaflash.models.device.placement import current_device
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.dflash import DFlashDrafter
from adaflash.models.drafters.checkpoint import as_dflash2, deepen_drafter, init_drafter, load_drafter, save_drafter
from adaflash.training.checkpoint import load_checkpoint, save_checkpoint, writing
from adaflash.models.targets.gguf_weights import GGUFWeights, source_gguf
from adaflash.models.targets.registry import resolve_target
from adaflash.models.targets.model import TargetModel, load_target
from adaflash.models.kv_cache.ragged import RaggedBatch
from adaflash.models.layers import rms_norm
from adaflash.models.drafters.draft_vocab import DraftHead, DraftVocab, count_tokens
from adaflash.training.datagen import load_manifest
from adaflash.training.dataset import (block_inputs, block_soft_targets, first_anchor, load_training_data,
                                      sample_anchors)
from adaflash.training.losses import IGNORE, SoftTargets, build_loss
from adaflash.training.selector_loss import selector_loss, teacher_forced_predecessors
from adaflash.training.validation import DecodedRun, decoded_accept_lengths, holdout_accept_lengths, split_holdout


@dataclass(frozen=True)
class TrainConfig:
    data_dir: str | tuple[str, ...]  # one regenerated-data directory, or several trained as one set
    out_dir: str
    model: str = "smollm2-135m"
    mask_token_id: int = 16
    # None: 2 layers / 16 tokens for a new drafter, init_from's own otherwise. With init_from, more layers than it has
    # deepens it (fresh layers appended as the identity) and another block size re-blocks it (the weights do not
    # depend on the block size): how a depth or block-size choice is measured from a trained drafter.
    num_layers: int | None = None
    block_size: int | None = None
    target_layer_ids: tuple[int, ...] | None = None  # default: DFlash's spread for num_layers
    intermediate_size: int | None = None
    init_from_target: bool = True
    # DFlash 2 (models/drafters/dflash2.py): a selector of this rank (0: none) over the top selector_top_k, and convolutions of
    # conv_kernel_size taps (0: none) in groups of conv_group_size; from init_from, a DFlash 1 drafter is upgraded
    # (identity convolutions, a fresh selector). The selector trains with its own loss (training/selector_loss.py).
    selector_rank: int = 0
    selector_top_k: int = 16
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_weight: float = 1.0
    init_from: str | None = None  # start from this drafter checkpoint (distillation) instead of a new one
    loss: str = "ce"  # ce (DFlash) | ce+kl (CE + KL to stored soft targets) | rkl | fkl | tv (AdaFlash distillation)
    soft_weight: float = 1.0  # ce+kl: weight of the KL term
    draft_vocab_size: int | None = None  # trim the drafter's head to the K most frequent target tokens of the data
    holdout_samples: int = 0  # samples kept out of training; their teacher-forced accept length is logged
    holdout_anchors: int = 32
    # Also walk each held-out response as decoding would: every anchor of every held-out sample, ~10x the random
    # anchors' cost (2.5 min a checkpoint for SmolLM2's 64 samples here); `python benchmarks/drafter/holdout.py`
    # scores finished drafters so.
    holdout_decoded: bool = False
    gamma: float = 7.0
    # "decay" (exp(-(k-1)/gamma)) or "dpace" (losses.dpace_weights, NVIDIA Model-Optimizer's D-PACE; ce loss only)
    position_weighting: str = "decay"
    dpace_alpha: float = 0.5
    alpha: float = 0.8  # distillation: weight of CE to the target argmax
    tau: float = 0.01  # distillation: per-token divergence floor
    temperature: float = 1.0  # distillation: softmax temperature of both distributions
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_frac: float = 0.04
    epochs: int = 1
    max_steps: int | None = None
    sequences_per_step: int = 4  # global, across all ranks
    anchors_per_sequence: int = 32  # 0: every valid position of the sequence ("anchors everywhere")
    grad_clip: float = 1.0
    autocast_bf16: bool = False  # for CPUs with native bf16 (always on CUDA)
    # Keep each sample's target pass (features, final states) in memory for later epochs and held-out scoring. Off for
    # a large one-epoch run: the target's forward inside the step is cheaper than holding ~4.6 KB a token.
    cache_teacher: bool = True
    seed: int = 0
    log_every: int = 10
    save_every: int = 50
    save_every_s: float | None = None  # also checkpoint when this many seconds passed since the last save
    time_limit_s: float | None = None  # end the run (checkpoint, export) once this many seconds of training passed

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "TrainConfig":
        path = Path(path)
        text = path.read_text()
        try:
            raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot parse training config {path}: {exc}") from exc
        raw.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"{path}: unknown training options {unknown}")
        for key in ("target_layer_ids", "data_dir"):
            if isinstance(raw.get(key), list):
                raw[key] = tuple(raw[key])
        return cls(**raw)


def _copy_target_layers(drafter: DFlashDrafter, target: TargetModel) -> None:
    """Initialise draft layer i from the i-th of the target's top layers (output space closest to the LM head): attention
    and norms, and the MLP where the target's layer has a dense one."""
    tc = target.config
    q, kv = tc.num_heads * tc.head_dim, tc.num_kv_heads * tc.head_dim
    first = tc.num_layers - len(drafter.layers)
    with torch.no_grad():
        for i, layer in enumerate(drafter.layers):
            src = target.layers[first + i]
            attn = layer.self_attn
            attn.q_proj.weight.copy_(src.qkv[:q])
            attn.k_proj.weight.copy_(src.qkv[q : q + kv])
            attn.v_proj.weight.copy_(src.qkv[q + kv :])
            attn.o_proj.weight.copy_(src.o)
            if src.q_norm is not None:
                attn.q_norm.weight.copy_(src.q_norm)
                attn.k_norm.weight.copy_(src.k_norm)
            if src.gate_up is not None:  # a mixture-of-experts layer has no dense MLP to start from: it stays fresh
                inter = tc.intermediate_size
                layer.mlp.gate_proj.weight.copy_(src.gate_up[:inter])
                layer.mlp.up_proj.weight.copy_(src.gate_up[inter:])
                layer.mlp.down_proj.weight.copy_(src.down)
            layer.input_layernorm.weight.copy_(src.input_norm)
            layer.post_attention_layernorm.weight.copy_(src.post_norm)


def data_vocab(samples, size: int, vocab_size: int) -> DraftVocab:
    """The `size` target tokens most frequent in the responses of training samples (the target's own outputs)."""
    return DraftVocab.most_frequent(count_tokens(s.tokens[s.prompt_len :] for s in samples), size, vocab_size)


def new_drafter(cfg: TrainConfig, target: TargetModel) -> DFlashDrafter:
    dcfg = DrafterConfig.for_target(
        target.config, mask_token_id=cfg.mask_token_id, num_layers=cfg.num_layers or 2, block_size=cfg.block_size or 16,
        intermediate_size=cfg.intermediate_size, target_layer_ids=cfg.target_layer_ids,
    )
    if cfg.selector_rank:
        dcfg = replace(dcfg, **_dflash2_fields(cfg))
    drafter = init_drafter(dcfg, seed=cfg.seed, dtype=torch.float32)
    if cfg.init_from_target and dcfg.intermediate_size == target.config.intermediate_size:
        _copy_target_layers(drafter, target)
    return drafter.train()


def continued_drafter(cfg: TrainConfig, target: TargetModel) -> DFlashDrafter:
    """init_from's drafter, deepened to cfg.num_layers and re-blocked to cfg.block_size where those are given."""
    drafter = load_drafter(cfg.init_from, dtype=torch.float32, device=target.device).train()
    drafter.config.check_compatible(target.config)
    if cfg.num_layers is not None and cfg.num_layers != drafter.config.num_layers:
        drafter = deepen_drafter(drafter, cfg.num_layers, seed=cfg.seed)
    if cfg.block_size is not None and cfg.block_size != drafter.config.block_size:
        drafter.config = replace(drafter.config, block_size=cfg.block_size)
    if cfg.selector_rank and not drafter.config.dflash2:
        drafter = as_dflash2(drafter, **_dflash2_fields(cfg), seed=cfg.seed)
    return drafter


def _dflash2_fields(cfg: TrainConfig) -> dict:
    return dict(conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
                selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k)


def training_target(cfg: TrainConfig, device: torch.device, needs_teacher: bool) -> TargetModel:
    """The frozen target: fp32 on a CPU (exact features, our kernels), bf16 on a GPU. Where it never runs - every data
    directory holds its features and the loss reads no teacher logits - a GGUF target on a CPU loads as int8: its
    linears stay blocks, so a 1.5B's training process holds ~3 GB, not the ~18 GB of its fp32 load; the embedding,
    all the drafter reads of it besides the LM head's rows (`dense_lm_head`), is fp32 either way."""
    checkpoint = resolve_target(cfg.model)
    dirs = (cfg.data_dir,) if isinstance(cfg.data_dir, (str, Path)) else cfg.data_dir
    manifests = [load_manifest(d) for d in dirs]
    stored = all(m is not None and m["config"].get("store_features", True) for m in manifests)
    copies_layers = cfg.init_from_target and cfg.init_from is None  # (a new drafter may start from its dense layers)
    light = (device.type == "cpu" and stored and not needs_teacher and not copies_layers
             and source_gguf(checkpoint) is not None)
    return load_target(checkpoint, torch.float32 if device.type == "cpu" else torch.bfloat16, device,
                       int8_activations=light)


def dense_lm_head(target: TargetModel, model: str) -> torch.Tensor:
    """The target's LM head in fp32: an int8 target's untied head is only blocks, dequantized here from its GGUF."""
    if not target.lm_head.is_meta:
        return target.lm_head
    return GGUFWeights(source_gguf(resolve_target(model))).dense("lm_head.weight")


def lr_factor(step: int, total: int, warmup_frac: float) -> float:
    """Linear warm-up, then cosine decay to zero."""
    warmup = max(1, int(total * warmup_frac))
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def teacher_pass(target: TargetModel, tokens: torch.Tensor, capture_layers) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over a whole trajectory: the drafter's context features of every position but the last
    [L-1, n*d], and the target's final-layer states [L, d] (its logits at any position, see `teacher_logits`).
    Cloned out of inference mode so autograd may read them."""
    last, d = target.config.num_layers - 1, target.config.hidden_size
    cache = target.new_cache(1, len(tokens))
    out = target(tokens, RaggedBatch.build([0], [0], [len(tokens)]), cache, (*capture_layers, last),
                 torch.tensor([len(tokens) - 1]))
    return out.hidden[:-1, :-d].clone(), out.hidden[:, -d:].clone()


def teacher_logits(target: TargetModel, final_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The target's logits at `positions` from its final-layer states (fp32)."""
    return target.logits(rms_norm(final_states[positions].to(target.dtype), target.final_norm, target.config.rms_norm_eps)).clone()


class TeacherCache:
    """Target passes per training sample, computed once: the target is frozen, so later epochs reuse them.
    `keep=False` computes them at every use (the target's forward inside the training step)."""

    def __init__(self, target: TargetModel, capture_layers, keep: bool = True) -> None:
        self.target, self.capture_layers, self.keep = target, tuple(capture_layers), keep
        self._store: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, index: int, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if index in self._store:
            return self._store[index]
        with torch.no_grad():
            features, final = teacher_pass(self.target, tokens, self.capture_layers)
        passed = (features.to(torch.bfloat16), final)  # features as the data shards keep them
        if self.keep:
            self._store[index] = passed
        return passed


def _sequence_loss(drafter, dcfg, target: TargetModel, head: DraftHead, index: int, sample, cfg: TrainConfig, loss_fn,
                   generator, teachers: TeacherCache, num_anchors: int | None = None):
    anchors = sample_anchors(sample, num_anchors or cfg.anchors_per_sequence, generator)
    block, gold_ids = block_inputs(sample, anchors, dcfg.block_size, dcfg.mask_token_id)
    labels = head.rows_of(gold_ids, ignore=IGNORE)  # MISS where the target's token is outside the draft vocabulary
    device = target.device
    block, labels = block.to(device), labels.to(device)
    features, teacher = sample.features, None
    if loss_fn.needs_soft_targets:
        logprobs, ids = block_soft_targets(sample, anchors, dcfg.block_size)
        teacher = SoftTargets(logprobs.to(device), head.rows_of(ids.to(device)))
    if features is None or loss_fn.needs_teacher:
        computed, final = teachers.get(index, sample.tokens)
        features = features if features is not None else computed
        if loss_fn.needs_teacher:
            # Block position k of anchor a predicts token a+k: the target's distribution for it is its logits
            # at position a+k-1. Anchors overlap, so the LM head runs once per distinct position.
            last = len(sample.tokens) - 2
            positions = (anchors[:, None] + torch.arange(dcfg.block_size - 1)[None, :]).clamp(max=last)
            unique, inverse = torch.unique(positions, return_inverse=True)
            with torch.no_grad():
                teacher = head.restrict(teacher_logits(target, final, unique.to(device)))[inverse.to(device)]
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.autocast_bf16 or device.type == "cuda"):
        hidden = drafter(features.to(device).float(), F.embedding(block, target.embed_tokens), anchors)
        # The (trimmed) LM head, frozen, on the draft positions only; plain F.linear keeps autograd.
        # (a checkpoint's output multiplier / soft cap on them: what the drafter drafts from)
        logits = getattr(drafter, "module", drafter).finish_logits(F.linear(hidden[:, 1:], head.weight).float())
    loss, stats = loss_fn(logits, labels, teacher)
    if dcfg.dflash2:  # (the drafter may be DDP-wrapped: the selector is its module's)
        selector = getattr(drafter, "module", drafter).candidate_selector
        predecessors = teacher_forced_predecessors(block, gold_ids.to(device))
        picked, picked_stats = selector_loss(selector, hidden[:, 1:], logits, labels, predecessors, head.ids)
        loss = loss + cfg.selector_weight * picked
        stats = {**stats, **picked_stats}  # what greedy verification keeps is the selector's path
    return loss, stats


def holdout_record(drafter: DFlashDrafter, target: TargetModel, head: DraftHead, dataset, holdout_ids, cfg: TrainConfig,
                   loss_fn, teachers: TeacherCache) -> dict:
    """The held-out numbers a checkpoint logs: `holdout` (expected accept length at random anchors) and, with
    cfg.holdout_decoded, `holdout_decoded` (the responses walked as greedy decoding would), per domain."""
    domains = [dataset.samples[i].domain for i in holdout_ids]

    def scored(i: int, generator: torch.Generator, num_anchors: int):
        return _sequence_loss(drafter, drafter.config, target, head, i, dataset.samples[i], cfg, loss_fn, generator,
                              teachers, num_anchors)

    def decoded_run(i: int) -> DecodedRun:
        sample = dataset.samples[i]
        _, stats = scored(i, torch.Generator(), len(sample.tokens))  # every anchor
        return DecodedRun(stats["run_lengths"], first_anchor(sample), sample.prompt_len, len(sample.tokens))

    record = {"holdout": holdout_accept_lengths(lambda i, g: scored(i, g, cfg.holdout_anchors), drafter, holdout_ids,
                                                domains, dataset.keys)}
    if cfg.holdout_decoded:
        record["holdout_decoded"] = decoded_accept_lengths(decoded_run, drafter, holdout_ids, domains)
    return record


def train(cfg: TrainConfig, progress: bool = True, stop_after: int | None = None,
          teachers: TeacherCache | None = None, on_checkpoint: Callable[[Path], None] | None = None) -> Path:
    """Train (or resume) a drafter; returns the directory of the final bf16 DFlash checkpoint.

    `stop_after` ends this invocation after that step (checkpoint saved, no export), as a time box or a
    kill would; running again resumes. `teachers` shares target passes between runs on the same data
    (a hyper-parameter sweep). `on_checkpoint(dir)` runs after every checkpoint is published (rank 0): e.g. a
    copy that leaves the machine while the run goes on.
    """
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    device = current_device()
    if distributed and device.type == "cuda":  # one GPU per rank
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if distributed and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if cfg.sequences_per_step % world:
        raise ValueError(f"sequences_per_step={cfg.sequences_per_step} must be divisible by the {world} ranks")
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(cfg.seed)
    loss_fn = build_loss(cfg.loss, gamma=cfg.gamma, alpha=cfg.alpha, tau=cfg.tau, temperature=cfg.temperature,
                         soft_weight=cfg.soft_weight, weighting=cfg.position_weighting, dpace_alpha=cfg.dpace_alpha)
    target = training_target(cfg, device, loss_fn.needs_teacher)

    def make_optimizer(model):
        return torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))

    resumed = load_checkpoint(out_dir, make_optimizer, device)
    if resumed is None:
        if cfg.init_from:
            drafter = continued_drafter(cfg, target)
        else:
            drafter = new_drafter(cfg, target)
        drafter = drafter.to(device)
        optimizer, step = make_optimizer(drafter), 0
    else:
        drafter, optimizer, step = resumed
    dataset = load_training_data(cfg.data_dir, drafter.config.target_layer_ids)
    if loss_fn.needs_soft_targets and not dataset.has_soft_targets:
        raise ValueError(f"loss {cfg.loss!r} needs soft targets: {cfg.data_dir} holds samples generated without "
                         "--top-logprobs")
    train_ids, holdout_ids = split_holdout(dataset.keys, cfg.holdout_samples)
    if cfg.draft_vocab_size and drafter.draft_vocab is not None and drafter.draft_vocab.size != cfg.draft_vocab_size:
        raise ValueError(f"draft_vocab_size = {cfg.draft_vocab_size}, but the drafter being trained already drafts over "
                         f"{drafter.draft_vocab.size} ids (init_from or the checkpoint in {cfg.out_dir})")
    if cfg.draft_vocab_size and drafter.draft_vocab is None and step == 0:
        drafter.set_draft_vocab(data_vocab([dataset.samples[i] for i in train_ids], cfg.draft_vocab_size, target.config.vocab_size))
    head = DraftHead(dense_lm_head(target, cfg.model), drafter.draft_vocab)
    teachers = teachers or TeacherCache(target, drafter.config.target_layer_ids, keep=cfg.cache_teacher)
    steps_per_epoch = len(train_ids) // cfg.sequences_per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(dataset)} samples cannot fill one step of {cfg.sequences_per_step} sequences")
    total = cfg.max_steps or steps_per_epoch * cfg.epochs
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(drafter, device_ids=[device] if device.type == "cuda" else None)
    else:
        model = drafter
    mean_response = sum(len(dataset.samples[i].tokens) - dataset.samples[i].prompt_len for i in train_ids) / len(train_ids)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, total, cfg.warmup_frac), last_epoch=step - 1)
    metrics_file = out_dir / "metrics.jsonl"
    bar = tqdm(total=total, initial=step, desc="train drafter", unit="step", disable=not progress or rank != 0)
    window: dict = {}

    def holdout() -> dict:
        return holdout_record(drafter, target, head, dataset, holdout_ids, cfg, loss_fn, teachers)

    if rank == 0 and holdout_ids and step == 0 and cfg.init_from:
        # Where a continued run starts (init_from's drafter on this data's held-out samples): the curve's first point.
        with metrics_file.open("a") as f:
            f.write(json.dumps({"step": 0, "train_tokens_seen": 0.0, **holdout()}) + "\n")
    started = last_save = time.perf_counter()
    while step < total:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        order = torch.randperm(len(train_ids), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
        picked = order[in_epoch * cfg.sequences_per_step : (in_epoch + 1) * cfg.sequences_per_step].tolist()
        global_ids = [train_ids[i] for i in picked]
        mine = global_ids[rank::world]
        optimizer.zero_grad(set_to_none=True)
        for j, idx in enumerate(mine):
            generator = torch.Generator().manual_seed(hash((cfg.seed, epoch, idx)) & 0x7FFFFFFF)
            sync = j == len(mine) - 1 or not distributed
            ctx = model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                loss, stats = _sequence_loss(model, drafter.config, target, head, idx, dataset.samples[idx], cfg,
                                             loss_fn, generator, teachers)
                (loss / len(mine)).backward()
            _accumulate(window, loss.item(), stats)
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        step += 1
        bar.update(1)
        # (a setting left unset costs the ranks no broadcast)
        out_of_time = cfg.time_limit_s is not None and _agreed(
            time.perf_counter() - started >= cfg.time_limit_s, distributed, device)
        last = step == total or out_of_time
        due_save = step % cfg.save_every == 0 or last or (cfg.save_every_s is not None and _agreed(
            time.perf_counter() - last_save >= cfg.save_every_s, distributed, device))
        due_log = step % cfg.log_every == 0 or last
        due_holdout = bool(holdout_ids) and (step % cfg.save_every == 0 or last)
        if rank == 0 and (due_log or due_holdout):
            record = (_summarise(window, step, scheduler.get_last_lr()[0], float(grad_norm), time.perf_counter() - started)
                      if due_log else {"step": step})
            record["train_tokens_seen"] = step * cfg.sequences_per_step * mean_response
            if due_holdout:
                record.update(holdout())
            with writing(out_dir, f"{metrics_file}"), metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
            if due_log:
                bar.set_postfix(loss=f"{record['loss']:.3f}", acc1=f"{record['accuracy'][0]:.2f}")
                window = {}
        if rank == 0 and due_save:
            save_checkpoint(out_dir, drafter, optimizer, step, asdict(cfg))
            if on_checkpoint is not None:
                on_checkpoint(out_dir / "checkpoint")
            last_save = time.perf_counter()
        if distributed:
            dist.barrier()
        if out_of_time:  # a time-boxed run ends as a finished one does: exported weights
            break
        if stop_after is not None and step >= stop_after and step < total:
            if rank == 0:
                save_checkpoint(out_dir, drafter, optimizer, step, asdict(cfg))
            bar.close()
            return out_dir / "checkpoint"
    bar.close()
    final = out_dir / "drafter"
    if rank == 0:
        with writing(out_dir, f"the trained drafter to {final}"):
            save_drafter(drafter, final, dtype=torch.bfloat16)
    if distributed:
        dist.barrier()
    return final


def _agreed(flag: bool, distributed: bool, device: torch.device) -> bool:
    """A time-based decision every rank takes together (rank 0's clock decides: ranks never part at a barrier)."""
    if not distributed:
        return flag
    decision = torch.tensor([float(flag)], device=device)
    dist.broadcast(decision, src=0)
    return bool(decision.item())


def _accumulate(window: dict, loss: float, stats: dict) -> None:
    window.setdefault("losses", []).append(loss)
    if "divergence" in stats:
        window.setdefault("divergences", []).append(stats["divergence"])
    for key in ("correct", "accepted", "valid"):
        acc = window.setdefault(key, [0] * len(stats[key]))
        for i, v in enumerate(stats[key]):
            acc[i] += v


def _summarise(window: dict, step: int, lr: float, grad_norm: float, elapsed: float) -> dict:
    valid = [max(1, v) for v in window["valid"]]
    accepted = [a / v for a, v in zip(window["accepted"], valid)]
    return {
        "step": step,
        "loss": sum(window["losses"]) / len(window["losses"]),
        "lr": lr,
        "grad_norm": grad_norm,
        "accuracy": [c / v for c, v in zip(window["correct"], valid)],
        # Expected tokens per verify pass if the greedy drafts were verified at these anchors (incl. bonus).
        "expected_accept_len": 1.0 + sum(accepted),
        "elapsed_s": elapsed,
        **({"divergence": sum(window["divergences"]) / len(window["divergences"])} if window.get("divergences") else {}),
    }
