"""`python -m tests.server.slow_serve serve ...`: the real `adaflash serve`, every engine step slowed by
$ADAFLASH_TEST_STEP_DELAY seconds, so a test can act while a stream is still in flight (shutdown tests)."""

from __future__ import annotations

import os
import sys
import time

from adaflash.cli import main
from adaflash.engine.engine import Engine

DELAY_S = float(os.environ.get("ADAFLASH_TEST_STEP_DELAY", "0"))
_step = Engine.step


def _slowed(self):
    time.sleep(DELAY_S)
    return _step(self)


if __name__ == "__main__":
    Engine.step = _slowed
    sys.exit(main(sys.argv[1:]))
