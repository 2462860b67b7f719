"""Hot-swap published drafter versions into a running engine (`adaflash serve --watch-versions DIR`).

A trainer (`adaflash online`, or anything calling `publish_version`) writes `DIR/vNNNN` and points
`DIR/LATEST` at it atomically; the watcher notices, loads the drafter and its length head off the engine
thread, and hands them to the engine between two steps. Running requests continue (their drafter context
is rebuilt) and stay lossless; a version that fails to load is logged and skipped, never half-applied.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from adaflash.models.drafter_checkpoint import latest_version, load_drafter
from adaflash.models.length_head import load_length_head
from adaflash.serving.runner import EngineRunner
from adaflash.speculative.proposer import DFlashProposer

log = logging.getLogger(__name__)


class VersionWatcher:
    def __init__(self, runner: EngineRunner, versions_dir: str | Path, make_policy: Callable, loaded: Path | None,
                 interval_s: float = 2.0) -> None:
        self.runner, self.versions_dir, self.make_policy = runner, Path(versions_dir), make_policy
        self.loaded, self.interval_s = loaded, interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check_once(self) -> Path | None:
        """Swap in LATEST if it changed; returns the version swapped in, else None."""
        latest = latest_version(self.versions_dir)
        if latest is None or latest == self.loaded:
            return None
        target = self.runner.engine.target
        proposer = DFlashProposer(load_drafter(latest, dtype=target.dtype), target)
        policy = self.make_policy(load_length_head(latest))
        self.runner.call(lambda engine: engine.swap_proposer(proposer, policy, latest.name)).result()
        self.loaded = latest
        log.warning("hot-swapped drafter version %s (length policy %s)", latest.name, policy.name)
        return latest

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # a bad version must not stop serving the current one
                log.exception("could not swap in the latest drafter version of %s", self.versions_dir)

    def start(self) -> "VersionWatcher":
        self._thread = threading.Thread(target=self._loop, name="adaflash-version-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
