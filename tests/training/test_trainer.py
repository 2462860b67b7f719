"""The one training loop: it learns, resumes exactly after a kill, and runs under torchrun (DDP, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adaflash.models.drafters.checkpoint import load_drafter
from adaflash.training.losses import BlockCrossEntropy, position_weights
from adaflash.training.trainer import TrainConfig, lr_factor, train

LAYERS = (1, 2)


def _config(tiny_checkpoints, tiny_data, out_dir, **kw) -> TrainConfig:
    base = dict(
        data_dir=tiny_data, out_dir=str(out_dir), model=tiny_checkpoints["llama"], mask_token_id=5, num_layers=2,
        block_size=4, target_layer_ids=LAYERS, lr=3e-3, epochs=1, max_steps=8, sequences_per_step=2,
        anchors_per_sequence=6, log_every=2, save_every=4, warmup_frac=0.1,
    )
    base.update(kw)
    return TrainConfig(**base)


def _weights(path) -> dict[str, torch.Tensor]:
    return load_drafter(path, dtype=torch.float32).state_dict()


def test_loss_weights_and_schedule():
    assert torch.allclose(position_weights(3, 7.0), torch.exp(-torch.tensor([0.0, 1.0, 2.0]) / 7.0))
    logits = torch.zeros(1, 3, 5)
    logits[0, 0, 2] = logits[0, 1, 4] = 10.0
    loss, stats = BlockCrossEntropy()(logits, torch.tensor([[2, 1, -100]]))
    assert stats["correct"] == [1, 0, 0] and stats["accepted"] == [1, 0, 0] and stats["valid"] == [1, 1, 0]
    assert loss > 0
    assert lr_factor(0, 100, 0.1) == pytest.approx(0.1) and lr_factor(10, 100, 0.1) == pytest.approx(1.0)
    assert lr_factor(100, 100, 0.1) == pytest.approx(0.0)


def test_training_learns_and_exports_dflash_checkpoint(tiny_checkpoints, tiny_data, tmp_path):
    cfg = _config(tiny_checkpoints, tiny_data, tmp_path, max_steps=30, lr=5e-3, save_every=30)
    final = train(cfg, progress=False)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < 0.7 * records[0]["loss"]
    assert {"accuracy", "expected_accept_len", "lr", "grad_norm"} <= set(records[-1])
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["dflash_config"]["target_layer_ids"] == [1, 2]
    from adaflash.training.summary import summarise, to_markdown

    summary = summarise(tmp_path)
    assert summary["steps"] == 30 and summary["final_loss"] < summary["first_loss"]
    assert len(summary["final_accuracy_by_position"]) == 3 and "expected accept length" in to_markdown(summary)


def _fp32_checkpoint(run_dir) -> dict[str, torch.Tensor]:
    return load_drafter(Path(run_dir) / "checkpoint", dtype=torch.float32).state_dict()


def _assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0, msg=name)


def test_resume_after_kill_is_exact(tiny_checkpoints, tiny_data, tmp_path):
    train(_config(tiny_checkpoints, tiny_data, tmp_path / "a"), progress=False)
    # Stop after step 4 as a kill would, then rerun the same command: it continues from the checkpoint.
    train(_config(tiny_checkpoints, tiny_data, tmp_path / "b"), progress=False, stop_after=4)
    state = torch.load(tmp_path / "b" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 4
    train(_config(tiny_checkpoints, tiny_data, tmp_path / "b"), progress=False)
    _assert_same_weights(_fp32_checkpoint(tmp_path / "a"), _fp32_checkpoint(tmp_path / "b"))  # fp32, exactly


def test_a_kill_between_the_checkpoint_renames_resumes_from_the_previous_checkpoint(tiny_checkpoints, tiny_data,
                                                                                   tmp_path):
    """The save renames checkpoint -> checkpoint.old, then checkpoint.tmp -> checkpoint: a kill between the two leaves
    no `checkpoint`. The rerun must resume from checkpoint.old (step 4 here), not restart from step 0, and end
    where an unbroken run ends."""
    train(_config(tiny_checkpoints, tiny_data, tmp_path / "a"), progress=False)
    run = tmp_path / "b"
    train(_config(tiny_checkpoints, tiny_data, run), progress=False, stop_after=4)
    (run / "checkpoint").rename(run / "checkpoint.old")  # the first rename done, the second never
    (run / "checkpoint.tmp").mkdir()  # the interrupted save's half-written folder
    started = []
    train(_config(tiny_checkpoints, tiny_data, run), progress=False,
          on_checkpoint=lambda d: started.append(torch.load(d / "trainer_state.pt", weights_only=False)["step"]))
    assert started == [8]  # one save after resuming at 4 (a restart from 0 would also save at 4)
    assert not (run / "checkpoint.old").exists()
    _assert_same_weights(_fp32_checkpoint(tmp_path / "a"), _fp32_checkpoint(run))


def test_sigkill_mid_run_resumes_to_the_unbroken_runs_weights(tiny_checkpoints, tiny_data, tmp_path):
    """A real kill: the training command in a subprocess, SIGKILLed once its first checkpoint is published (the steps
    after it are lost mid-flight), then the same command again: the fp32 weights equal an unbroken run's."""
    import signal
    import time

    kw = dict(max_steps=40, save_every=10)
    train(_config(tiny_checkpoints, tiny_data, tmp_path / "a", **kw), progress=False)
    cfg = _config(tiny_checkpoints, tiny_data, tmp_path / "b", **kw)
    cfg_file = tmp_path / "b.json"
    cfg_file.write_text(json.dumps(cfg.__dict__))
    cmd = [sys.executable, "-m", "adaflash.cli", "--threads", "1", "train", "drafter", "--config", str(cfg_file)]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    log = tmp_path / "b.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    state = tmp_path / "b" / "checkpoint" / "trainer_state.pt"
    deadline = time.monotonic() + 120
    while not state.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, f"the run ended before it could be killed: {log.read_text()[-2000:]}"
    assert not (tmp_path / "b" / "drafter").exists()
    published = state if state.is_file() else tmp_path / "b" / "checkpoint.old" / "trainer_state.pt"  # killed mid-save
    killed_at = torch.load(published, weights_only=False)["step"]
    assert 10 <= killed_at < 40
    subprocess.run(cmd, env=env, check=True, capture_output=True, timeout=300)
    _assert_same_weights(_fp32_checkpoint(tmp_path / "a"), _fp32_checkpoint(tmp_path / "b"))


def test_trimmed_vocabulary_with_soft_targets_learns_resumes_and_ships(tiny_checkpoints, tiny_soft_data, tmp_path):
    kw = dict(data_dir=tiny_soft_data, loss="ce+kl", draft_vocab_size=24, holdout_samples=2, holdout_decoded=True,
              max_steps=12, lr=5e-3, save_every=6, log_every=6)
    straight = train(_config(tiny_checkpoints, tiny_soft_data, tmp_path / "a", **kw), progress=False)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] < records[0]["loss"] and "divergence" in records[-1]
    # The held-out samples' accept length is logged per domain with every checkpoint.
    assert set(records[-1]["holdout"]) <= {"all", "chat", "math"} and records[-1]["holdout"]["all"] >= 1.0
    drafter = load_drafter(straight, dtype=torch.float32)
    assert drafter.draft_vocab is not None and drafter.draft_vocab.size == 24
    # The vocabulary is the training responses' most frequent tokens (held-out samples excluded).
    from adaflash.training.dataset import DraftDataset
    from adaflash.training.trainer import data_vocab
    from adaflash.training.validation import split_holdout

    data = DraftDataset(tiny_soft_data, LAYERS)
    train_ids, _ = split_holdout(data.keys, 2)
    expected = data_vocab([data.samples[i] for i in train_ids], 24, drafter.config.vocab_size)
    assert drafter.draft_vocab.token_ids.tolist() == expected.token_ids.tolist()
    train(_config(tiny_checkpoints, tiny_soft_data, tmp_path / "b", **kw), progress=False, stop_after=6)
    resumed = train(_config(tiny_checkpoints, tiny_soft_data, tmp_path / "b", **kw), progress=False)
    for (name, a), (_, b) in zip(_weights(straight).items(), _weights(resumed).items()):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)
    assert load_drafter(resumed).draft_vocab.token_ids.tolist() == expected.token_ids.tolist()
    from benchmarks.drafter.scaling_curve import plot_scaling_curve
    from adaflash.training.summary import summarise, to_markdown

    summary = summarise(tmp_path / "a")
    assert [r["step"] for r in summary["holdout_curve"]] == [6, 12] and "training tokens seen" in to_markdown(summary)
    assert [r["step"] for r in summary["decoded_curve"]] == [6, 12] and "Held-out decoded" in to_markdown(summary)
    assert plot_scaling_curve(summary["holdout_curve"], tmp_path / "curve.png", "t").stat().st_size > 0
    # A run continued from that drafter logs where it starts: its held-out accept length at step 0 (the same samples and
    # anchors; the shipped weights are bf16, so close to, not bitwise, the last in-memory measurement).
    train(_config(tiny_checkpoints, tiny_soft_data, tmp_path / "c", **{**kw, "max_steps": 6}, init_from=str(straight)),
          progress=False)
    start = json.loads((tmp_path / "c" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["step"] == 0 and "loss" not in start
    assert start["holdout"]["all"] == pytest.approx(records[-1]["holdout"]["all"], abs=0.25)
    assert [r["step"] for r in summarise(tmp_path / "c")["holdout_curve"]] == [0, 6]


def test_soft_target_loss_needs_soft_target_data(tiny_checkpoints, tiny_data, tmp_path):
    with pytest.raises(ValueError, match="top-logprobs"):
        train(_config(tiny_checkpoints, tiny_data, tmp_path, loss="ce+kl"), progress=False)


def test_config_file_errors(tmp_path):
    bad = tmp_path / "c.json"
    bad.write_text(json.dumps({"data_dir": "d", "out_dir": "o", "lr_typo": 1}))
    with pytest.raises(ValueError, match="lr_typo"):
        TrainConfig.from_file(bad)
    toml = tmp_path / "c.toml"
    toml.write_text('data_dir = "d"\nout_dir = "o"\ntarget_layer_ids = [1, 2]\n')
    assert TrainConfig.from_file(toml, max_steps=3).target_layer_ids == (1, 2)


def test_torchrun_two_processes_matches_single_process(tiny_checkpoints, tiny_data, tmp_path):
    """DDP over 2 CPU processes (gloo) averages gradients: same weights as one process on the same batches."""
    train(_config(tiny_checkpoints, tiny_data, tmp_path / "init", max_steps=4), progress=False, stop_after=0)
    start = _fp32_checkpoint(tmp_path / "init")  # after the first of the four steps
    train(_config(tiny_checkpoints, tiny_data, tmp_path / "single", max_steps=4), progress=False)
    cfg = _config(tiny_checkpoints, tiny_data, tmp_path / "ddp", max_steps=4)
    cfg_file = tmp_path / "ddp.json"
    cfg_file.write_text(json.dumps({k: v for k, v in cfg.__dict__.items()}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
         "-m", "adaflash.cli", "train", "drafter", "--config", str(cfg_file)],
        check=True, env=env, capture_output=True, timeout=300,
    )
    # On the fp32 checkpoints, within 1e-4: four AdamW steps at lr 3e-3 move weights by up to ~1e-2, so a run that
    # never averaged gradients (each rank stepping on half the batch) or never trained lands far outside it.
    ddp, one = _fp32_checkpoint(tmp_path / "ddp"), _fp32_checkpoint(tmp_path / "single")
    assert ddp.keys() == one.keys()
    for name in one:
        torch.testing.assert_close(ddp[name], one[name], atol=1e-4, rtol=0, msg=name)
    moved = max((one[n] - start[n]).abs().max().item() for n in one if n in start)
    assert moved > 1e-3  # trained: the tolerance is far below what training moved


def test_a_continued_run_deepens_and_reblocks_its_drafter(tiny_checkpoints, tiny_data, tmp_path):
    """init_from + more layers grows the drafter (fresh identity layers); another block size re-blocks it."""
    base = train(_config(tiny_checkpoints, tiny_data, tmp_path / "base", max_steps=4), progress=False)
    grown = train(_config(tiny_checkpoints, tiny_data, tmp_path / "deep", max_steps=4, init_from=str(base), num_layers=3,
                          block_size=3), progress=False)
    config = json.loads((grown / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["block_size"] == 3
    kept, trained = _weights(base), _weights(grown)
    assert set(kept) < set(trained) and any(k.startswith("layers.2.") for k in trained)
    assert not torch.equal(kept["layers.0.mlp.down_proj.weight"], trained["layers.0.mlp.down_proj.weight"])
    # Continuing with the checkpoint's own shape (num_layers / block_size unset) keeps it.
    same = train(_config(tiny_checkpoints, tiny_data, tmp_path / "same", max_steps=2, init_from=str(grown),
                         num_layers=None, block_size=None), progress=False)
    assert json.loads((same / "config.json").read_text())["num_hidden_layers"] == 3


def test_a_full_disk_at_a_checkpoint_names_the_intact_one_which_resumes(tiny_checkpoints, tiny_data, tmp_path,
                                                                        monkeypatch):
    """The disk fills while the step-8 checkpoint is written: the run stops saying so and naming the step-4
    checkpoint, whose half-written successor is cleaned away; with space again it resumes to an unbroken run's weights."""
    import errno

    from adaflash.training import checkpoint

    kw = dict(max_steps=12, save_every=4)
    train(_config(tiny_checkpoints, tiny_data, tmp_path / "a", **kw), progress=False)
    real_save, saves = checkpoint.save_drafter, []

    def full_disk_at_the_second_checkpoint(drafter, path, **kwargs):
        saves.append(path)
        real_save(drafter, path, **kwargs)  # the disk fills part-way through the write
        if len(saves) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_drafter", full_disk_at_the_second_checkpoint)
    out = tmp_path / "b"
    with pytest.raises(OSError, match=rf"could not write the step 8 checkpoint .*No space left on device; "
                                      rf"{out / 'checkpoint'} \(step 4\) is intact"):
        train(_config(tiny_checkpoints, tiny_data, out, **kw), progress=False)
    assert not (out / "checkpoint.tmp").exists() and torch.load(out / "checkpoint" / "trainer_state.pt",
                                                                weights_only=False)["step"] == 4
    monkeypatch.setattr(checkpoint, "save_drafter", real_save)
    train(_config(tiny_checkpoints, tiny_data, out, **kw), progress=False)
    _assert_same_weights(_fp32_checkpoint(tmp_path / "a"), _fp32_checkpoint(out))
