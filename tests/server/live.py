"""Helpers for the tests of a networked server: an app over its own engine, and a real uvicorn on a loopback port."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Iterator

import uvicorn

from adaflash.engine.engine import Engine
from adaflash.engine.runner import EngineRunner
from adaflash.server.gate import ServerConfig
from adaflash.server.server import create_app
from adaflash.speculative.length_policy import FixedLength
from tests.server.test_server import MODEL, slow_steps, wait_for


@contextlib.contextmanager
def app_over_engine(pipeline, config: ServerConfig = ServerConfig(), max_batch: int = 2, max_queue: int = 4,
                    max_len: int = 512, step_delay: float = 0.0, prompt_lookup=None) -> Iterator[tuple]:
    """(app, runner): a dflash engine (fixed:3; prompt-lookup drafts first if given) on its own started runner,
    stopped on exit."""
    engine = Engine(pipeline.target, pipeline.proposer, FixedLength(3), max_batch=max_batch, max_queue=max_queue,
                    max_len=max_len, prompt_lookup=prompt_lookup)
    if step_delay:
        slow_steps(engine, step_delay)
    runner = EngineRunner(engine).start()
    try:
        yield create_app(runner, pipeline.tokenizer, MODEL, config=config), runner
    finally:
        runner.stop()


@contextlib.contextmanager
def live_server(app) -> Iterator[str]:
    """A real uvicorn serving `app` on a free loopback port (held from the start: no race); yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert wait_for(lambda: server.started)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()
