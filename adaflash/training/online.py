"""`adaflash online`: serve -> collect trajectories -> distill + refit the head -> publish -> hot-swap, in rounds.

One process runs the serving engine (continuous batching, on its own thread, exactly as `serve` does) and,
between rounds, the trainer - on that same thread, between two engine steps, so that all the compute shares one
OpenMP pool (a second pool slows every parallel region: engine/runner.py, EngineRunner.launch). Each round serves
fresh GSM-Symbolic problems with the current drafter while a recorder writes the on-policy buffer; then the
drafter is distilled on the buffer (reverse KL by default), its candidate-length head is refitted on the new
drafter's own block outcomes, and the candidate is scored on a held-out slice (full-block greedy accept length
along target trajectories). Only a candidate that scores better is published (`versions/vNNNN`, atomic) and
hot-swapped into the running engine between two steps; a worse one is rolled back (not promoted). A killed run resumes at its last finished round.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from adaflash.data import GSMSymbolicStream, load_prompts
from adaflash.engine.engine_factory import EngineConfig, build_engine, length_policy_factory
from adaflash.engine.recorder import TrajectoryRecorder
from adaflash.engine.request import Request
from adaflash.engine.runner import EngineRunner
from adaflash.formats.trajectories import Trajectory, append_trajectories, read_trajectories
from adaflash.models.drafters.checkpoint import latest_version, load_drafter, load_drafter_config, publish_version
from adaflash.models.drafters.length_head import load_length_head, save_length_head
from adaflash.pipeline import Pipeline
from adaflash.speculative.config import SpeculativeConfig
from adaflash.speculative.proposer import DFlashProposer
from adaflash.training.block_outcomes import score_blocks
from adaflash.training.length_head import LengthHeadTrainConfig, train_length_head
from adaflash.training.trainer import TrainConfig, train


@dataclass(frozen=True)
class OnlineConfig:
    out_dir: str
    drafter: str  # the starting checkpoint (published as v0001)
    model: str = "smollm2-135m"
    dtype: str = "auto"
    rounds: int = 5
    prompts_per_round: int = 16
    held_out_prompts: int = 12
    max_new_tokens: int = 128
    max_batch: int = 8
    distill_steps: int = 40
    loss: str = "rkl"
    alpha: float = 0.8
    tau: float = 0.01
    gamma: float = 7.0
    lr: float = 3e-4
    sequences_per_step: int = 2
    anchors_per_sequence: int = 32
    head_kind: str = "position"
    head_epochs: int = 40
    head_lr: float = 1e-3
    seed: int = 0


def serve_prompts(runner: EngineRunner, prompt_ids: list[list[int]], max_new_tokens: int, stop: tuple[int, ...],
                  tag: str) -> tuple[list[Request], float]:
    """Submit every prompt to the running engine at once and wait for all; (requests, wall seconds)."""
    requests = [Request(f"{tag}-{i}", ids, max_new_tokens, stop_token_ids=stop) for i, ids in enumerate(prompt_ids)]

    async def one(request: Request) -> None:
        async for _ in await runner.submit(request):
            pass

    async def all_of() -> None:
        await asyncio.gather(*(one(r) for r in requests))

    start = time.perf_counter()
    asyncio.run(all_of())
    return requests, time.perf_counter() - start


class OnlineAdaptation:
    def __init__(self, cfg: OnlineConfig) -> None:
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.versions = self.out / "versions"
        if latest_version(self.versions) is None:
            publish_version(cfg.drafter, self.versions)
        self.current = latest_version(self.versions)

        def build():
            pipeline = Pipeline.load(cfg.model, self.current, cfg.dtype)
            models = pipeline.engine_models(drafter_version=self.current.name)
            config = EngineConfig(self._speculative(models.length_head), max_batch=cfg.max_batch, max_len=1024)
            policies = length_policy_factory(config, models)  # its cost model serves every round's policy
            return build_engine(config, models, policies(models.length_head), policies.checks), (pipeline, policies)

        self.runner, (self.pipeline, self.policies) = EngineRunner.launch(build)
        self.target = self.pipeline.target
        self.log_file = self.out / "online.json"
        self.rounds: list[dict] = json.loads(self.log_file.read_text())["rounds"] if self.log_file.is_file() else []

    @staticmethod
    def _speculative(head) -> SpeculativeConfig:
        # The learned policy (adaflash) once the drafter carries a head; until then dflash's expected-throughput one.
        return SpeculativeConfig.of("adaflash" if head is not None else "dflash")

    def _policy(self, head):
        return replace(self.policies, spec=self._speculative(head).engine_policy)(head)

    def _encode(self, prompts) -> list[list[int]]:
        return [self.pipeline.encode(messages=p.messages) for p in prompts]

    def _trajectories(self, name: str, prompts) -> list[Trajectory]:
        """Greedy target trajectories of a fixed prompt slice (drafter-independent: lossless), computed once."""
        path = self.out / f"{name}.jsonl"
        if not path.is_file():
            requests, _ = serve_prompts(self.runner, self._encode(prompts), self.cfg.max_new_tokens,
                                        self.pipeline.stop_token_ids, name)
            append_trajectories(path, [Trajectory(tuple(r.prompt_ids), tuple(r.output_ids), source=name) for r in requests])
        return read_trajectories(path)

    def _on_engine(self, fn):
        """fn() on the engine thread between two steps (the trainer's and scorer's compute), its result here."""
        return self.runner.call(lambda engine: fn()).result()

    def _score(self, drafter_dir: Path, trajectories) -> float:
        return self._on_engine(lambda: score_blocks(self.target, load_drafter(drafter_dir, torch.float32, self.target.device),
                                                    trajectories, seed=self.cfg.seed).accept_length)

    def run(self) -> list[dict]:
        cfg = self.cfg
        with self.runner:
            held_out = self._trajectories("held_out", GSMSymbolicStream(seed=10_000 + cfg.seed).take(cfg.held_out_prompts))
            gsm8k = self._trajectories("gsm8k_eval", load_prompts("gsm8k", "eval", limit=cfg.held_out_prompts))
            if not self.rounds:
                self._write({"round": 0, "version": self.current.name, "held_out_accept_len": self._score(self.current, held_out),
                             "gsm8k_accept_len": self._score(self.current, gsm8k), "promoted": True})
            for r in range(len(self.rounds), cfg.rounds + 1):
                self._round(r, held_out, gsm8k)
        return self.rounds

    def _round(self, r: int, held_out, gsm8k) -> None:
        cfg = self.cfg
        buffer = self.out / "buffer" / f"round-{r:03d}"
        shutil.rmtree(buffer, ignore_errors=True)  # a round killed while serving is served again (same prompts)
        recorder = TrajectoryRecorder(buffer, drafter_version=self.current.name, source="gsm-symbolic", record_outcomes=False)
        self.runner.call(lambda e: setattr(e, "recorder", recorder)).result()
        prompts = GSMSymbolicStream(seed=cfg.seed * 1000 + r).take(cfg.prompts_per_round)
        requests, wall = serve_prompts(self.runner, self._encode(prompts), cfg.max_new_tokens, self.pipeline.stop_token_ids, f"r{r}")
        self.runner.call(lambda e: setattr(e, "recorder", None)).result()
        passes = [a for q in requests for a in q.accept_lengths]
        served = {"served_tokens_per_s": sum(len(q.output_ids) for q in requests) / wall,
                  "served_accept_len": sum(passes) / max(1, len(passes))}

        # Distill on the whole buffer so far (replay), from the current version; then refit the head.
        candidate = self._on_engine(lambda: self._distill(r))
        report = self._on_engine(lambda: self._refit_head(r, candidate))

        now, new = self.rounds[-1]["held_out_accept_len"] if self.rounds else 0.0, self._score(candidate, held_out)
        promoted = new > now
        if promoted:
            self.current = publish_version(candidate, self.versions)
            self.runner.call(lambda e: e.swap_proposer(
                DFlashProposer(load_drafter(self.current, self.target.dtype, self.target.device), self.target),
                self._policy(load_length_head(self.current, self.target.device)), self.current.name)).result()
        self._write({"round": r, "version": self.current.name, "candidate_held_out_accept_len": new,
                     "held_out_accept_len": new if promoted else now, "promoted": promoted,
                     "gsm8k_accept_len": self._score(self.current, gsm8k), "trajectories": len(requests),
                     "head_ece": report.get("ece_after", report.get("ece")), **served})

    def _distill(self, r: int) -> Path:
        cfg = self.cfg
        run_dir = self.out / "train" / f"round-{r:03d}"
        return train(TrainConfig(
            data_dir=str(self.out / "buffer"), out_dir=str(run_dir), model=cfg.model, init_from=str(self.current),
            loss=cfg.loss, alpha=cfg.alpha, tau=cfg.tau, gamma=cfg.gamma, lr=cfg.lr, max_steps=cfg.distill_steps,
            sequences_per_step=cfg.sequences_per_step, anchors_per_sequence=cfg.anchors_per_sequence,
            warmup_frac=0.1, seed=cfg.seed + r, save_every=max(10, cfg.distill_steps // 2),
        ), progress=False)

    def _refit_head(self, r: int, candidate: Path) -> dict:
        """The head refitted on the candidate's own outcomes (the old drafter's hidden states are not its inputs)."""
        cfg = self.cfg
        scores = score_blocks(self.target, load_drafter(candidate, torch.float32, self.target.device),
                              read_trajectories(self.out / "buffer"), anchors_per_sequence=cfg.anchors_per_sequence,
                              seed=cfg.seed + r)
        d = load_drafter_config(candidate)
        head, report = train_length_head(scores.outcomes, LengthHeadTrainConfig(
            kind=cfg.head_kind, epochs=cfg.head_epochs, lr=cfg.head_lr, seed=cfg.seed + r), d.hidden_size, d.block_size,
            device=self.target.device)
        save_length_head(head, candidate)
        return report

    def _write(self, record: dict) -> None:
        self.rounds.append(record)
        tmp = self.log_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"config": asdict(self.cfg), "rounds": self.rounds}, indent=2) + "\n")
        os.replace(tmp, self.log_file)
        print(json.dumps(record), flush=True)
