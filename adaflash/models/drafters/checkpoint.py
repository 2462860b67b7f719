"""Save and load drafters as DFlash-schema checkpoints: `config.json` + `model.safetensors`.

Only the drafter's own weights are stored (no embedding, no LM head), in bf16 by default, so a drafter
trained here loads in vLLM / SGLang, and a public DFlash checkpoint loads here.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from adaflash.models.files import read_config_json
from adaflash.models.device.placement import placed
from adaflash.models.drafters.dflash2 import GroupedDynamicCausalConv, codebook_keys
from adaflash.models.drafters.draft_vocab import VOCAB_FILE, DraftVocab
from adaflash.models.drafters.config import DrafterConfig
from adaflash.models.drafters.dflash import DFlashDrafter
from adaflash.models.files import atomic_write, check_state, read_tensors, save_tensors

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # sharded weights, as HF (and vLLM, SGLang) write and read them


def save_drafter(drafter: DFlashDrafter, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int | None = None) -> Path:
    """Write atomically: files land under temporary names and are renamed into place. `max_shard_bytes`: weights larger
    than this go into HF-style shards (model-0000i-of-0000n.safetensors + model.safetensors.index.json), e.g. to
    leave a machine through a channel that carries files up to a size."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in drafter.state_dict().items()}
    _save_weights(path, state, max_shard_bytes)
    if drafter.draft_vocab is not None:
        drafter.draft_vocab.save(path)
    else:
        (path / VOCAB_FILE).unlink(missing_ok=True)
    atomic_write(path / CONFIG_FILE, lambda tmp: Path(tmp).write_text(json.dumps(drafter.config.to_hf_dict(), indent=2) + "\n"))
    return path


def _save_weights(path: Path, state: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for stale in [path / WEIGHTS_FILE, path / INDEX_FILE, *path.glob("model-*-of-*.safetensors")]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        save_tensors(path / WEIGHTS_FILE, state)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_tensors(path / name, shard)
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
             "weight_map": weight_map}
    atomic_write(path / INDEX_FILE, lambda tmp: Path(tmp).write_text(json.dumps(index, indent=2) + "\n"))


def _read_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """The weights of a drafter folder (one file or HF-style shards) and the file to name in errors."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a usable shard index: {exc}") from exc
        state: dict[str, torch.Tensor] = {}
        for name in files:
            if not (path / name).is_file():
                raise FileNotFoundError(f"{index} names {name}, which is missing")
            state.update(read_tensors(path / name))
        return state, index
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        raise FileNotFoundError(f"drafter checkpoint {path} has no {WEIGHTS_FILE} (nor a sharded {INDEX_FILE})")
    return read_tensors(weights_file), weights_file


def load_drafter_config(path: str | Path) -> DrafterConfig:
    raw = read_config_json(path, "a DFlash drafter checkpoint (config.json + model.safetensors)")
    try:
        return DrafterConfig.from_hf_dict(raw)
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"{Path(path) / CONFIG_FILE} is not a usable DFlash drafter config: {exc}") from exc


def load_drafter(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
                 draft_vocab: str | None = None) -> DFlashDrafter:
    """`draft_vocab`: None (as saved), "full" (ignore a trimmed vocabulary) or K (keep its K most frequent ids).
    `device`: default the process's (models/device/placement.py)."""
    path = Path(path)
    config = load_drafter_config(path)
    state, weights_file = _read_weights(path)
    bare = codebook_keys(("predecessor_codebook", "successor_codebook"))
    state = {bare.get(k, k): v for k, v in state.items()}
    with torch.device("meta"):
        drafter = DFlashDrafter(config)
    check_state(weights_file, state, drafter.state_dict())
    drafter.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    if config.draft_vocab_size:
        raw = read_config_json(path, "a DFlash drafter checkpoint (config.json + model.safetensors)")
        drafter.set_draft_vocab(DraftVocab.load(path, raw["draft_vocab"], config.vocab_size))
    if draft_vocab is not None:
        drafter.set_draft_vocab(_cut_vocab(drafter.draft_vocab, draft_vocab, path))
    return drafter.to(placed(device)).eval()


def _cut_vocab(vocab: DraftVocab | None, spec: str, path: Path) -> DraftVocab | None:
    if str(spec) == "full":
        return None
    if not str(spec).isdigit():
        raise ValueError(f"a draft vocabulary cut is 'full' or a number of ids, got {spec!r}")
    if vocab is None:
        raise ValueError(f"drafter {path} has no trimmed vocabulary to cut to {spec} ids (it drafts over the full one)")
    try:
        return vocab.truncated(int(spec))
    except ValueError as exc:
        raise ValueError(f"drafter {path}: {exc}") from exc


def init_drafter(config: DrafterConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> DFlashDrafter:
    """A freshly initialised drafter (normal(0, 0.02) linears, unit norms), reproducible from `seed`."""
    generator = torch.Generator().manual_seed(seed)
    drafter = DFlashDrafter(config)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
        for module in drafter.modules():  # DFlash 2's convolutions start as the identity, as its paper's do
            if isinstance(module, GroupedDynamicCausalConv):
                module.reset_to_identity()
    return drafter.to(dtype).eval()


def deepen_drafter(drafter: DFlashDrafter, num_layers: int, seed: int = 0) -> DFlashDrafter:
    """`drafter` with fresh layers appended up to `num_layers`, each starting as the identity on the residual stream
    (its output projections zero), so the deeper drafter first drafts exactly as the trained one did and training
    adds capacity instead of starting over."""
    have = drafter.config.num_layers
    if num_layers < have:
        raise ValueError(f"cannot make a {have}-layer drafter shallower ({num_layers} layers asked)")
    deeper = init_drafter(replace(drafter.config, num_layers=num_layers), seed=seed, dtype=drafter.dtype)
    with torch.no_grad():
        result = deeper.load_state_dict(drafter.state_dict(), strict=False)
        fresh = {k for k in deeper.state_dict() if any(k.startswith(f"layers.{i}.") for i in range(have, num_layers))}
        assert not result.unexpected_keys and set(result.missing_keys) == fresh, result
        for layer in deeper.layers[have:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    deeper.set_draft_vocab(drafter.draft_vocab)
    return deeper.train(drafter.training)


def as_dflash2(drafter: DFlashDrafter, conv_kernel_size: int, conv_group_size: int, selector_rank: int,
               selector_top_k: int, seed: int = 0) -> DFlashDrafter:
    """`drafter` (DFlash 1) with DFlash 2's modules added: convolutions as the identity and a fresh selector, so the
    backbone first drafts exactly as the trained one did and training adds the selector and the convolutions."""
    if drafter.config.dflash2:
        raise ValueError("the drafter is DFlash 2 already")
    config = replace(drafter.config, conv_kernel_size=conv_kernel_size, conv_group_size=conv_group_size,
                     selector_rank=selector_rank, selector_top_k=selector_top_k)
    upgraded = init_drafter(config, seed=seed, dtype=drafter.dtype).to(drafter.device)
    with torch.no_grad():
        result = upgraded.load_state_dict(drafter.state_dict(), strict=False)
    assert not result.unexpected_keys and all("conv" in k or k.startswith("candidate_selector.")
                                              for k in result.missing_keys), result
    upgraded.set_draft_vocab(drafter.draft_vocab)
    return upgraded.train(drafter.training)


LATEST_FILE = "LATEST"


def publish_version(source: str | Path, versions_dir: str | Path) -> Path:
    """Copy a drafter checkpoint to `versions_dir/vNNNN` and point `LATEST` at it, each step atomic (a rename):
    a reader (a serving process watching the directory) sees the old version or the new, never half of one."""
    import shutil

    versions_dir = Path(versions_dir)
    versions_dir.mkdir(parents=True, exist_ok=True)
    numbers = [int(p.name[1:]) for p in versions_dir.glob("v[0-9][0-9][0-9][0-9]") if p.is_dir()]
    final = versions_dir / f"v{max(numbers, default=0) + 1:04d}"
    tmp = versions_dir / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    tmp.rename(final)
    pointer = versions_dir / f".{LATEST_FILE}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, versions_dir / LATEST_FILE)
    return final


def latest_version(versions_dir: str | Path) -> Path | None:
    """The version `LATEST` names, or None before the first publish."""
    pointer = Path(versions_dir) / LATEST_FILE
    if not pointer.is_file():
        return None
    path = Path(versions_dir) / pointer.read_text().strip()
    if not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(f"{pointer} names {path.name}, which holds no drafter checkpoint")
    return path
