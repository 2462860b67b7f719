"""Candidate-length heads: shapes, length rounding/clipping, survival, and the in-drafter checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from adaflash.models.drafters.length_head import (CONFIG_KEY, HEAD_FILE, BlockLengthHead, LengthHeadConfig,
    PositionAcceptanceHead, build_length_head, load_length_head, save_length_head)

D, B = 12, 6


def _cfg(kind: str, **kw) -> LengthHeadConfig:
    return LengthHeadConfig(kind=kind, hidden_size=D, block_size=B, head_dim=16, **kw)


def _hidden(n: int = 5, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, B, D, generator=torch.Generator().manual_seed(seed))


def _fixed_ratio_head(ratio: float, rate: float = 1.0) -> BlockLengthHead:
    """A block head whose output is `ratio` whatever the input: zero final weights, bias = logit(ratio)."""
    head = BlockLengthHead(_cfg("block", rate=rate))
    with torch.no_grad():
        head.out.weight.zero_()
        head.out.bias.fill_(torch.logit(torch.tensor(ratio, dtype=torch.float64)).item())
    return head


def _drafter_dir(tmp_path):
    path = tmp_path / "drafter"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"dflash_config": {"mask_token_id": 7}, "other": 1}))
    (path / "model.safetensors").write_bytes(b"not read by these tests")
    return path


def test_config_round_trip_and_validation():
    cfg = _cfg("position", temperature=1.7)
    assert LengthHeadConfig.from_dict(cfg.to_dict()) == cfg
    assert LengthHeadConfig.from_dict({**cfg.to_dict(), "future_field": 3}) == cfg
    with pytest.raises(ValueError, match="block, position"):
        LengthHeadConfig(kind="tree", hidden_size=D, block_size=B)
    with pytest.raises(ValueError, match="block, position"):
        LengthHeadConfig.from_dict({"kind": "tree", "hidden_size": D, "block_size": B})
    with pytest.raises(ValueError, match="temperature"):
        _cfg("position", temperature=0.0)


def test_block_head_shapes_range_and_dtypes():
    head = build_length_head(_cfg("block"))
    assert isinstance(head, BlockLengthHead)
    hidden = _hidden()
    ratio = head(hidden)
    assert ratio.shape == (5,) and ratio.dtype == torch.float32
    assert bool(((ratio > 0) & (ratio < 1)).all())
    with torch.inference_mode():
        bf16 = head(hidden.bfloat16())
    assert bf16.dtype == torch.float32
    torch.testing.assert_close(bf16, ratio.detach(), atol=2e-2, rtol=0)
    lengths = head.draft_lengths(hidden)
    assert lengths.dtype == torch.long and bool(((lengths >= 0) & (lengths <= B - 1)).all())
    with pytest.raises(ValueError, match=r"\[N, 6, 12\]"):
        head(torch.randn(2, B + 1, D))


def test_block_head_features_are_mean_and_last_position():
    head = build_length_head(_cfg("block"))
    hidden = _hidden(3)
    permuted = hidden.clone()
    permuted[:, : B - 1] = hidden[:, torch.randperm(B - 1)]  # same mean, same last position
    torch.testing.assert_close(head(permuted), head(hidden))
    changed_last = hidden.clone()
    changed_last[:, -1] += 1.0
    changed_last[:, 0] -= 1.0  # mean unchanged, last position changed
    assert not torch.allclose(head(changed_last), head(hidden))


@pytest.mark.parametrize(
    "ratio, rate, want_drafts",
    [
        (0.999, 1.0, B - 1),  # round(5.99) = 6 = B -> 5 drafts
        (0.999, 1.3, B - 1),  # 7.8 clipped to B
        (0.01, 1.0, 0),  # round(0.06) = 0 clipped up to 1 -> 0 drafts
        (0.5, 1.0, 2),  # 3 candidates incl. the anchor -> 2 drafts
        (0.4, 1.0, 1),  # round(2.4) = 2 -> 1 draft
        (0.45, 1.0, 2),  # round(2.7) = 3 -> 2 drafts
        (0.4, 1.25, 2),  # round(3.0) = 3 -> 2 drafts: the rate scales the candidate length
    ],
)
def test_draft_lengths_round_and_clip(ratio, rate, want_drafts):
    head = _fixed_ratio_head(ratio, rate)
    lengths = head.draft_lengths(_hidden(4))
    assert lengths.tolist() == [want_drafts] * 4


def test_position_head_probs_and_survival():
    head = build_length_head(_cfg("position"))
    assert isinstance(head, PositionAcceptanceHead)
    with torch.no_grad():
        head.position_bias.copy_(torch.linspace(2.0, -2.0, B - 1))
    hidden = _hidden(7)
    logits = head(hidden)
    assert logits.shape == (7, B - 1)
    probs, surv = head.accept_probs(hidden), head.survival(hidden)
    assert bool(((probs > 0) & (probs < 1)).all())
    assert bool((surv[:, 1:] <= surv[:, :-1]).all())
    torch.testing.assert_close(surv[:, 0], probs[:, 0])
    torch.testing.assert_close(surv[:, 2], probs[:, 0] * probs[:, 1] * probs[:, 2])
    # The anchor's hidden state does not enter any position's prediction.
    moved = hidden.clone()
    moved[:, 0] += 5.0
    torch.testing.assert_close(head(moved), logits)
    # Temperature divides the logits.
    head.set_temperature(2.0)
    torch.testing.assert_close(head.accept_probs(hidden), torch.sigmoid(logits / 2.0))
    assert head.config.temperature == 2.0


def test_save_load_round_trip_keeps_other_keys(tmp_path):
    path = _drafter_dir(tmp_path)
    for kind in ("block", "position"):
        head = build_length_head(_cfg(kind, rate=1.2, temperature=1.5))
        with torch.no_grad():
            for p in head.parameters():
                p.add_(0.1 * torch.randn_like(p))
        save_length_head(head, path)
        raw = json.loads((path / "config.json").read_text())
        assert raw["other"] == 1 and raw["dflash_config"] == {"mask_token_id": 7}
        assert raw[CONFIG_KEY] == head.config.to_dict()
        loaded = load_length_head(path)
        assert type(loaded) is type(head) and loaded.config == head.config and not loaded.training
        hidden = _hidden(3)
        with torch.inference_mode():
            torch.testing.assert_close(loaded(hidden), head(hidden), rtol=0, atol=0)
    assert not [p.name for p in path.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_load_returns_none_without_key(tmp_path):
    assert load_length_head(_drafter_dir(tmp_path)) is None


def test_bad_head_files_name_the_file(tmp_path):
    path = _drafter_dir(tmp_path)
    save_length_head(build_length_head(_cfg("position")), path)
    data = (path / HEAD_FILE).read_bytes()
    (path / HEAD_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=HEAD_FILE):
        load_length_head(path)
    (path / HEAD_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=HEAD_FILE):
        load_length_head(path)
    # Weights of a differently sized head: shapes do not match the config.
    other = PositionAcceptanceHead(LengthHeadConfig(kind="position", hidden_size=D, block_size=B, head_dim=8))
    save_length_head(other, path)
    raw = json.loads((path / "config.json").read_text())
    raw[CONFIG_KEY]["head_dim"] = 16
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=HEAD_FILE):
        load_length_head(path)
    # Weights of the other kind.
    raw[CONFIG_KEY]["kind"] = "block"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=HEAD_FILE):
        load_length_head(path)
