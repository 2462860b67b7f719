"""Hot-swap published drafter versions into a running engine (`adaflash serve --watch-versions DIR`).

A trainer (`adaflash online`, or anything calling `publish_version`) writes `DIR/vNNNN` and points
`DIR/LATEST` at it atomically; the watcher notices it and has the engine thread, between two steps, load the
drafter and its length head and swap them in (all compute stays on that one thread: runner.EngineRunner.launch says
why). Running requests continue (their drafter context is rebuilt) and stay lossless.

A version that fails to load (a corrupt or truncated file) or does not fit the target (another hidden size,
layer count, vocabulary, capture layers or block size) is refused: the incumbent keeps serving, the refusal
is logged with the file at fault and counted (`adaflash_hot_swap_refused_total`), and that version is not
tried again; the next one published is.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from adaflash.engine.runner import EngineRunner, RunnerStoppedError
from adaflash.models.drafters.checkpoint import (CONFIG_FILE, LATEST_FILE, latest_version, load_drafter,
    load_drafter_config)
from adaflash.models.drafters.length_head import load_length_head
from adaflash.speculative.proposer import DFlashProposer

log = logging.getLogger(__name__)


class VersionRefused(ValueError):
    """A published version this engine cannot serve (the message names the file at fault)."""


class VersionWatcher:
    def __init__(self, runner: EngineRunner, versions_dir: str | Path, make_policy: Callable, loaded: Path | None,
                 interval_s: float = 2.0, observer: Callable[[bool], None] | None = None,
                 draft_vocab: str | None = None) -> None:
        """`observer(swapped)`: called once per version swapped in (True) or refused (False), e.g. metrics.
        `draft_vocab`: the server's `--draft-vocab`, applied to every version as to the first."""
        self.runner, self.versions_dir, self.make_policy = runner, Path(versions_dir), make_policy
        self.draft_vocab = draft_vocab
        self.loaded, self.interval_s, self.observer = loaded, interval_s, observer
        self.refused: dict[Path, str] = {}  # version -> why (never retried)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _prepare(self, version: Path):
        """The new proposer and policy, or VersionRefused; run on the engine thread, nothing touches the engine yet."""
        serving = self.runner.snapshot  # never the engine itself: it belongs to the engine thread
        target = serving.target
        try:
            config = load_drafter_config(version)
            config.check_compatible(target.config)
        except ValueError as exc:
            raise VersionRefused(f"{version / CONFIG_FILE}: {exc}") from exc
        if tuple(config.target_layer_ids) != serving.capture_layers or config.block_size != serving.max_draft + 1:
            raise VersionRefused(
                f"{version / CONFIG_FILE}: reads target layers {tuple(config.target_layer_ids)} with block size "
                f"{config.block_size}, the serving drafter layers {serving.capture_layers} with block size "
                f"{serving.max_draft + 1} (a hot swap cannot change either)")
        try:
            proposer = DFlashProposer(load_drafter(version, target.dtype, target.device, self.draft_vocab), target)
            policy = self.make_policy(load_length_head(version, target.device))
        except (ValueError, FileNotFoundError, OSError, RuntimeError) as exc:  # their messages name the file
            raise VersionRefused(str(exc)) from exc
        return proposer, policy

    def _swap_in(self, engine, version: Path):
        """On the engine thread: load `version` and swap it in; its policy (VersionRefused before any change)."""
        proposer, policy = self._prepare(version)
        engine.swap_proposer(proposer, policy, version.name)
        return policy

    def check_once(self) -> Path | None:
        """Swap in LATEST if it changed and can be served; returns the version swapped in, else None."""
        try:
            latest = latest_version(self.versions_dir)
        except FileNotFoundError as exc:  # LATEST names a directory without a checkpoint
            latest = self.versions_dir / (self.versions_dir / LATEST_FILE).read_text().strip()
            self._refuse(latest, str(exc))
            return None
        if latest is None or latest == self.loaded or latest in self.refused:
            return None
        try:
            # Loaded on the engine thread, between two steps (~a second of load): packing the weights on this
            # thread would give OpenMP a second worker pool, which slows every later step (EngineRunner.launch).
            policy = self.runner.call(lambda engine: self._swap_in(engine, latest)).result()
        except RunnerStoppedError:
            return None  # shutting down: not the version's fault
        except ValueError as exc:  # VersionRefused, or the engine's own check (raised before it changes anything)
            self._refuse(latest, str(exc))
            return None
        self.loaded = latest
        log.warning("hot-swapped drafter version %s (length policy %s)", latest.name, policy.name)
        self._notify(True)
        return latest

    def _refuse(self, version: Path, reason: str) -> None:
        if version in self.refused:
            return
        self.refused[version] = reason
        log.error("refused drafter version %s: %s; still serving %s", version.name, reason,
                  self.loaded.name if self.loaded else "the startup drafter")
        self._notify(False)

    def _notify(self, swapped: bool) -> None:
        if self.observer is not None:
            try:
                self.observer(swapped)
            except Exception:  # metrics must never stop the watcher
                log.exception("hot-swap observer failed")

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check_once()
            except Exception:  # a bug or a transient I/O error must not stop serving the current version
                log.exception("could not check the latest drafter version of %s", self.versions_dir)

    def start(self) -> "VersionWatcher":
        self._thread = threading.Thread(target=self._loop, name="adaflash-version-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
