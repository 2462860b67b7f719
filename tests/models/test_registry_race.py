"""A GGUF target resolved by several processes at once (torchrun's ranks) is prepared once, and every process gets
the finished directory; a truncated GGUF is refused naming the file."""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path

from adaflash.models.targets import registry
from adaflash.models.targets.gguf_weights import _stamp


def _slow_preparation(gguf: Path, out_dir: Path) -> None:
    """Stands in for preparing a GGUF's directory: logs the call, takes a while, writes what the real one does."""
    with (out_dir.parent.parent / "preparations.log").open("a") as log:
        log.write(f"{gguf}\n")
    time.sleep(0.5)
    out_dir.mkdir()
    (out_dir / "config.json").write_text("{}")
    (out_dir / "SOURCE").write_text(_stamp(gguf) + "\n")


def _resolve(gguf: str, start, results) -> None:
    registry.prepare_checkpoint = _slow_preparation  # this process's registry (a forked copy)
    start.wait()
    try:
        results.put(str(registry.resolve_target(gguf)))
    except Exception as exc:  # noqa: BLE001 (reported to the parent)
        results.put(f"error: {exc!r}")


def test_ranks_racing_on_one_gguf_prepare_it_once(tmp_path, monkeypatch):
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
    (out_dir,) = (tmp_path / "cache" / "targets").glob("tiny-*-gguf")
    assert got == [str(out_dir)] * 3
    assert (out_dir / "config.json").read_text() == "{}"
    assert (tmp_path / "cache" / "targets" / "preparations.log").read_text().splitlines() == [str(gguf)]
    monkeypatch.setattr(registry, "prepare_checkpoint", _slow_preparation)
    gguf.write_bytes(b"GGUF, another version")  # a changed file is prepared again
    assert registry.resolve_target(str(gguf)) == out_dir
    assert (out_dir / "SOURCE").read_text().strip() == _stamp(gguf)


def test_a_truncated_gguf_is_refused_naming_the_file_and_nothing_is_cached(tmp_path, monkeypatch):
    import pytest

    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "cut.gguf"
    data = registry.target_gguf().read_bytes()
    gguf.write_bytes(data[: len(data) // 2])  # an interrupted download
    with pytest.raises(ValueError, match=f"{gguf} is not a readable GGUF checkpoint"):
        registry.resolve_target(str(gguf))
    assert not list((tmp_path / "cache" / "targets").glob("cut-*"))
