"""On-disk cache of parsed prompt sets (JSONL), outside the repository.

Location: `$ADAFLASH_CACHE/data` if `ADAFLASH_CACHE` is set, else `$XDG_CACHE_HOME/adaflash/data`,
else `~/.cache/adaflash/data`. Files are written to a temp file in the same directory and renamed, so
a crash or a concurrent process never leaves a half-written cache behind. A cache file's name carries
the source package version and a format version, so stale caches are simply ignored.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from adaflash.data.prompt import Prompt, package_file
from adaflash.data.splits import bucket

# Bump when the parsing/splitting logic changes, so old caches are not reused.
CACHE_FORMAT = 1


def cache_dir() -> Path:
    root = os.environ.get("ADAFLASH_CACHE")
    if root:
        return Path(root).expanduser() / "data"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "adaflash" / "data"


def write_prompts_atomic(path: Path, prompts: Iterable[Prompt]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for p in prompts:
                # ASCII escapes: any odd code point in scraped text round-trips safely.
                f.write(json.dumps(p.to_dict()) + "\n")
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a cache is not secret
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_prompts_cache(path: Path) -> list[Prompt]:
    with path.open(encoding="utf-8") as f:
        return [Prompt.from_dict(json.loads(line)) for line in f if line.strip()]


def cached_prompts(name: str, build: Callable[[], list[Prompt]]) -> list[Prompt]:
    """Return the prompts cached under `name`, building and caching them on a miss.

    A corrupt or unreadable cache is rebuilt; an unwritable cache directory only costs speed.
    """
    path = cache_dir() / f"{name}.v{CACHE_FORMAT}.jsonl"
    if path.exists():
        try:
            return read_prompts_cache(path)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # fall through and rebuild
    prompts = build()
    with contextlib.suppress(OSError):
        write_prompts_atomic(path, prompts)
    return prompts


def cached_package_prompts(
    dist: str, relpath: str, pip_spec: str, cache_name: str, order: str, build: Callable[[], list[Prompt]]
) -> tuple[Prompt, ...]:
    """A packaged prompt set, cached under `cache_name` and sorted by the hash of (id, `order`): a fixed
    order in which a `limit` prefix is a mixed sample.

    The package is checked first, so a missing install fails with instructions even if a cache exists.
    """
    package_file(dist, relpath, pip_spec)
    prompts = cached_prompts(cache_name, build)
    return tuple(sorted(prompts, key=lambda p: bucket(p.id, order)))
