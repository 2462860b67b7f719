"""A GGUF target resolved by several processes at once (torchrun's ranks) is converted once, and every process gets
the finished directory; a truncated GGUF is refused naming the file."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from adaflash.models.targets import registry


def _slow_conversion(gguf: Path, out_dir: Path) -> None:
    """Stands in for the GGUF conversion: logs the call, takes a while, publishes by rename as the real one does."""
    with (out_dir.parent / "conversions.log").open("a") as log:
        log.write(f"{gguf}\n")
    tmp = out_dir.parent / f".convert-{multiprocessing.current_process().pid}"
    tmp.mkdir()
    time.sleep(0.5)
    (tmp / "model.safetensors").write_text("weights")
    if out_dir.exists():  # what made the unlocked race fail: one rank's rmtree under another's rename
        raise RuntimeError(f"{out_dir} converted twice")
    tmp.rename(out_dir)


def _resolve(gguf: str, start, results) -> None:
    registry._convert_gguf = _slow_conversion  # this process's registry (a forked copy)
    start.wait()
    try:
        results.put(str(registry.resolve_target(gguf)))
    except Exception as exc:  # noqa: BLE001 (reported to the parent)
        results.put(f"error: {exc!r}")


def test_ranks_racing_on_one_gguf_convert_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(3), ctx.Queue()
    ranks = [ctx.Process(target=_resolve, args=(str(gguf), start, results)) for _ in range(3)]
    for p in ranks:
        p.start()
    got = [results.get(timeout=60) for _ in ranks]
    for p in ranks:
        p.join(timeout=60)
    out_dir = tmp_path / "cache" / "targets" / "tiny-fp32"
    assert got == [str(out_dir)] * 3
    assert (out_dir / "model.safetensors").read_text() == "weights"
    assert (out_dir.parent / "conversions.log").read_text().splitlines() == [str(gguf)]


def test_a_truncated_gguf_is_refused_naming_the_file_and_nothing_is_cached(tmp_path, monkeypatch):
    import pytest

    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "cut.gguf"
    data = registry.target_gguf().read_bytes()
    gguf.write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(ValueError, match=f"{gguf} is not a readable GGUF checkpoint"):
        registry.resolve_target(str(gguf))
    assert not (tmp_path / "cache" / "targets" / "cut-fp32").exists()
