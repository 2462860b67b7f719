"""Length-head training: censoring labels, calibration metrics, temperature fit, outcomes files, CLI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from adaflash.formats.outcomes import Outcomes, load_outcomes, save_outcomes
from adaflash.models.targets.config import TransformerConfig
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.checkpoint import init_drafter, load_drafter, save_drafter
from adaflash.models.drafters.length_head import CONFIG_KEY, BlockLengthHead, PositionAcceptanceHead, load_length_head
from adaflash.plots import plot_reliability
from adaflash.training.cli import register_cli
from adaflash.training.length_head import (
    LengthHeadTrainConfig,
    block_labels,
    expected_calibration_error,
    fit_temperature,
    position_labels,
    reliability_bins,
    train_length_head,
    uncensored,
)

B, D = 6, 8


def _synthetic(n: int, seed: int, block: int = B, dim: int = D) -> tuple[Outcomes, torch.Tensor]:
    """Acceptance of draft k depends on hidden[:, k, 0] (true P = sigmoid(3 x)); a per-request latent shifts
    every position, so the block mean carries the accepted length too. Some outcomes are censored."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, block, dim, generator=g)
    hidden[:, :, 0] += torch.randn(n, 1, generator=g)
    p_true = torch.sigmoid(3.0 * hidden[:, 1:, 0])
    success = torch.rand(n, block - 1, generator=g) < p_true
    full = torch.cumprod(success.long(), dim=-1).sum(-1)
    drafted = torch.where(
        torch.rand(n, generator=g) < 0.7, torch.full((n,), block - 1), torch.randint(0, block, (n,), generator=g)
    )
    accepted = torch.minimum(full, drafted)
    return Outcomes(hidden=hidden, drafted=drafted, accepted=accepted), p_true


# ---------------------------------------------------------------- labels and metrics


def test_censoring_labels_on_a_hand_written_case():
    drafted = torch.tensor([4, 2, 3, 0, 4])
    accepted = torch.tensor([2, 2, 0, 0, 4])
    labels, mask = position_labels(drafted, accepted, block_size=5)
    assert mask.tolist() == [
        [True, True, True, False],  # rejection seen at draft 3
        [True, True, False, False],  # all 2 drafts accepted: draft 3 unknown
        [True, False, False, False],  # rejected at draft 1
        [False, False, False, False],  # nothing drafted
        [True, True, True, True],  # the whole block accepted
    ]
    assert (labels * mask).tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert uncensored(drafted, accepted, 5).tolist() == [True, False, True, False, True]
    label, keep = block_labels(drafted, accepted, 5)
    torch.testing.assert_close(label, torch.tensor([0.6, 0.6, 0.2, 0.2, 1.0]))
    assert keep.tolist() == [True, False, True, False, True]


def test_ece_on_hand_computed_cases():
    assert expected_calibration_error(torch.full((4,), 0.25), torch.tensor([1.0, 0, 0, 0])) == pytest.approx(0.0)
    assert expected_calibration_error(torch.full((10,), 0.9), torch.tensor([1.0] * 5 + [0.0] * 5)) == pytest.approx(0.4)
    pred, label = torch.tensor([0.15, 0.15, 0.85, 0.85]), torch.tensor([0.0, 0.0, 1.0, 0.0])
    assert expected_calibration_error(pred, label) == pytest.approx(0.5 * 0.15 + 0.5 * 0.35)
    rows = reliability_bins(torch.tensor([0.0, 1.0, 0.55]), torch.tensor([0.0, 1.0, 1.0]))
    assert len(rows) == 10 and sum(r["count"] for r in rows) == 3
    assert rows[0]["count"] == 1 and rows[9]["count"] == 1 and rows[5]["count"] == 1
    assert rows[5]["mean_pred"] == pytest.approx(0.55) and rows[5]["frac_pos"] == 1.0
    assert rows[3] == {"bin_lo": 0.3, "bin_hi": 0.4, "mean_pred": None, "frac_pos": None, "count": 0}
    with pytest.raises(ValueError):
        expected_calibration_error(torch.zeros(0), torch.zeros(0))


def test_temperature_fit_recovers_a_known_scale():
    g = torch.Generator().manual_seed(3)
    logits = 2.0 * torch.randn(20000, generator=g)
    labels = (torch.rand(20000, generator=g) < torch.sigmoid(logits)).float()
    assert fit_temperature(2.0 * logits, labels) == pytest.approx(2.0, rel=0.2)
    assert fit_temperature(0.5 * logits, labels) == pytest.approx(0.5, rel=0.2)
    assert fit_temperature(logits, labels) == pytest.approx(1.0, rel=0.2)


def test_plot_reliability_writes_a_png(tmp_path):
    rows = reliability_bins(torch.linspace(0, 1, 50), (torch.arange(50) % 2).float())
    path = plot_reliability(rows, tmp_path / "rel.png", "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- outcomes files


def test_outcomes_round_trip_split_and_concat(tmp_path):
    outcomes, _ = _synthetic(40, seed=0)
    save_outcomes(tmp_path / "a.safetensors", outcomes)
    save_outcomes(tmp_path / "b.safetensors", outcomes.select(torch.arange(10)))
    loaded = load_outcomes([tmp_path / "a.safetensors", tmp_path / "b.safetensors"])
    assert len(loaded) == 50 and loaded.hidden.dtype == torch.bfloat16
    torch.testing.assert_close(loaded.hidden[:40].float(), outcomes.hidden.bfloat16().float())
    assert loaded.drafted[:40].tolist() == outcomes.drafted.tolist()
    assert loaded.accepted[40:].tolist() == outcomes.accepted[:10].tolist()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    train, held = outcomes.split(0.25, seed=1)
    again, _ = outcomes.split(0.25, seed=1)
    assert (len(train), len(held)) == (30, 10)
    assert torch.equal(train.hidden, again.hidden)
    rows = {tuple(h.flatten().tolist()) for h in torch.cat([train.hidden, held.hidden])}
    assert len(rows) == 40
    other, _ = outcomes.split(0.25, seed=2)
    assert not torch.equal(train.hidden, other.hidden)


def test_outcomes_errors_name_the_file(tmp_path):
    outcomes, _ = _synthetic(8, seed=0)
    good = save_outcomes(tmp_path / "good.safetensors", outcomes)
    data = good.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="cut.safetensors"):
        load_outcomes([good, tmp_path / "cut.safetensors"])
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_outcomes([tmp_path / "nope.safetensors"])
    wide, _ = _synthetic(8, seed=0, dim=D + 1)
    save_outcomes(tmp_path / "wide.safetensors", wide)
    with pytest.raises(ValueError, match="wide.safetensors"):
        load_outcomes([good, tmp_path / "wide.safetensors"])
    with pytest.raises(ValueError, match="accepted <= drafted"):
        Outcomes(hidden=torch.zeros(1, B, D), drafted=torch.tensor([1]), accepted=torch.tensor([2]))


# ---------------------------------------------------------------- training


def test_position_head_learns_and_is_calibrated():
    outcomes, _ = _synthetic(4000, seed=0)
    cfg = LengthHeadTrainConfig(kind="position", head_dim=32, lr=1e-2, epochs=8, batch_size=128, seed=0)
    head, report = train_length_head(outcomes, cfg, hidden_size=D, block_size=B)
    assert isinstance(head, PositionAcceptanceHead)
    assert report["n_train"] == 3200 and report["n_held_out"] == 800
    assert report["ece_after"] < 0.05
    assert report["brier"] < 0.8 * report["brier_constant"]
    assert report["accepted_mae"] < 0.8 * report["accepted_mae_constant"]
    assert head.config.temperature == pytest.approx(report["temperature"])
    assert sum(r["count"] for r in report["reliability"]) == report["n_held_out_positions"]
    # The trained head tracks the true conditional acceptance on fresh data.
    fresh, p_true = _synthetic(500, seed=9)
    with torch.inference_mode():
        err = (head.accept_probs(fresh.hidden) - p_true).abs().mean()
    assert err < 0.06


def test_block_head_beats_the_mean():
    outcomes, _ = _synthetic(3000, seed=1)
    cfg = LengthHeadTrainConfig(kind="block", head_dim=32, lr=1e-2, epochs=8, batch_size=128, seed=0)
    head, report = train_length_head(outcomes, cfg, hidden_size=D, block_size=B)
    assert isinstance(head, BlockLengthHead)
    assert report["n_fit"] < report["n_train"]  # censored outcomes were left out
    assert report["accepted_mae"] < 0.9 * report["accepted_mae_constant"]
    assert report["mse"] < 0.8 * report["mse_constant"]
    assert 0.0 <= report["ece"] < 0.1


def test_training_is_deterministic_and_checks_shapes():
    outcomes, _ = _synthetic(300, seed=2)
    cfg = LengthHeadTrainConfig(kind="position", head_dim=8, lr=1e-2, epochs=2, batch_size=64, seed=5)
    a, ra = train_length_head(outcomes, cfg, hidden_size=D, block_size=B)
    b, rb = train_length_head(outcomes, cfg, hidden_size=D, block_size=B)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert ra == rb
    with pytest.raises(ValueError, match="drafter has"):
        train_length_head(outcomes, cfg, hidden_size=D + 1, block_size=B)
    with pytest.raises(ValueError, match="block, position"):
        LengthHeadTrainConfig(kind="tree")


# ---------------------------------------------------------------- CLI


def _tiny_drafter_dir(path):
    target = TransformerConfig(
        family="qwen3", vocab_size=96, hidden_size=16, intermediate_size=32, num_layers=4, num_heads=2,
        num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        qkv_bias=False, o_bias=False, qk_norm=True, max_position_embeddings=128,
    )
    cfg = DrafterConfig.for_target(target, mask_token_id=7, num_layers=1, block_size=4)
    return save_drafter(init_drafter(cfg), path)


@pytest.mark.parametrize("kind", ["position", "block"])
def test_cli_trains_and_saves_into_a_copy(tmp_path, kind):
    drafter = _tiny_drafter_dir(tmp_path / "drafter")
    outcomes, _ = _synthetic(200, seed=4, block=4, dim=16)
    save_outcomes(tmp_path / "o1.safetensors", outcomes.select(torch.arange(120)))
    save_outcomes(tmp_path / "o2.safetensors", outcomes.select(torch.arange(120, 200)))
    parser = argparse.ArgumentParser()
    register_cli(parser.add_subparsers(dest="command", required=True))
    out, report, plot = tmp_path / "out", tmp_path / "report.json", tmp_path / "rel.png"
    args = parser.parse_args([
        "train", "length-head", "--outcomes", str(tmp_path / "o1.safetensors"), str(tmp_path / "o2.safetensors"),
        "--drafter", str(drafter), "--out", str(out), "--kind", kind, "--epochs", "2", "--lr", "1e-2",
        "--head-dim", "8", "--report", str(report), "--plot", str(plot),
    ])
    assert args.func(args) == 0
    head = load_length_head(out)
    assert head is not None and head.config.kind == kind
    assert (head.config.hidden_size, head.config.block_size) == (16, 4)
    data = json.loads(report.read_text())
    assert data["n_train"] + data["n_held_out"] == 200 and data["kind"] == kind
    assert plot.is_file()
    assert load_drafter(out).config.hidden_size == 16  # still a loadable drafter
    assert CONFIG_KEY not in json.loads((drafter / "config.json").read_text())  # source untouched
    assert load_length_head(drafter) is None
