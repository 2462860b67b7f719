"""The JSONL cache: location, atomic writes, reuse, and recovery from a corrupt file."""

from pathlib import Path

from adaflash.data import Prompt
from adaflash.data.cache import CACHE_FORMAT, cache_dir, cached_prompts


def _prompts():
    text = "q{} \u00e9\u6f22 \U0001f600"  # non-ASCII must round-trip
    return [Prompt(f"t/{i}", "chat", "t", ({"role": "user", "content": text.format(i)},)) for i in range(3)]


def test_cache_dir_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path / "data"
    monkeypatch.delenv("ADAFLASH_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "adaflash" / "data"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "adaflash" / "data"


def test_build_once_then_reuse(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    calls = []

    def build():
        calls.append(1)
        return _prompts()

    assert cached_prompts("demo", build) == _prompts()
    assert cached_prompts("demo", build) == _prompts()
    assert len(calls) == 1
    files = sorted(p.name for p in (tmp_path / "data").iterdir())
    assert files == [f"demo.v{CACHE_FORMAT}.jsonl"]  # no temp file left behind


def test_corrupt_cache_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAFLASH_CACHE", str(tmp_path))
    path = tmp_path / "data" / f"demo.v{CACHE_FORMAT}.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text('{"id": "t/0", "doma')
    assert cached_prompts("demo", _prompts) == _prompts()
    assert cached_prompts("demo", lambda: []) == _prompts()  # the rebuilt file is valid


def test_unwritable_cache_still_returns_prompts(monkeypatch, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("ADAFLASH_CACHE", str(blocker))
    assert cached_prompts("demo", _prompts) == _prompts()
