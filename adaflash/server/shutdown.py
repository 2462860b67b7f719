"""Graceful shutdown: on SIGTERM or Ctrl-C, drain, then exit 0.

The first signal starts a drain: the listening socket stays open but new `/v1` requests get 503 (so a
client or load balancer learns at once, instead of a refused connection) and `/health` answers 503
"draining"; the requests already admitted run to their end. When none is left, or after the drain timeout,
the server stops (the ones still running are aborted first: each client gets an error naming the
shutdown, a stream still ends with `data: [DONE]`). A second signal aborts the rest at once; a third
exits without waiting for anything.

uvicorn's own handler would close the listener at the first signal and re-raise the signal after shutting
down (so the process dies by it); this subclass does neither.
"""

from __future__ import annotations

import logging
import time

import uvicorn

from adaflash.server.gate import Admission

log = logging.getLogger(__name__)

ABORT_GRACE_S = 5.0  # after aborting, how long the aborted responses get to reach their clients


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, drain_timeout_s: float = 30.0) -> None:
        if drain_timeout_s < 0:
            raise ValueError(f"the drain timeout must be >= 0 seconds, got {drain_timeout_s}")
        super().__init__(config)
        self.admission, self.drain_timeout_s = admission, drain_timeout_s
        self.signals = 0  # set by the signal handler only; everything else happens on the event loop
        self._drain_deadline: float | None = None
        self._aborted_at: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler: set flags only (no logging, no locks); on_tick acts on them.
        self.signals += 1
        self.admission.draining = True
        if self.signals >= 3:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if await super().on_tick(counter):
            return True
        if not self.signals:
            return False
        now = time.monotonic()
        if self._drain_deadline is None:
            self._drain_deadline = now + self.drain_timeout_s
            log.warning("shutting down: draining %d request(s) in flight for up to %.0f s (new ones get 503)",
                        self.admission.in_flight, self.drain_timeout_s)
        if self.signals >= 2:
            self._drain_deadline = min(self._drain_deadline, now)
        if self.admission.in_flight == 0:
            return True
        if now >= self._drain_deadline and self._aborted_at is None:
            self._aborted_at = now
            aborted = self.admission.abort_all()
            log.warning("drain time is up: aborted %d request(s) still running", aborted)
        return self._aborted_at is not None and now >= self._aborted_at + ABORT_GRACE_S


def serve(app, admission: Admission, *, host: str, port: int, log_level: str, drain_timeout_s: float) -> None:
    """Run the app until a signal and its drain end (blocks; returns normally, so the caller can exit 0)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=int(ABORT_GRACE_S))
    DrainingServer(config, admission, drain_timeout_s).run()

