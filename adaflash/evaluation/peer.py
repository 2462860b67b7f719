"""llama.cpp as the measured peer: where `make peer` put its binaries, and servers launched for a benchmark.

Everything here drives real processes: `launched_process` starts one, waits until its health URL answers and
stops it on exit; `llama_server_command` is the llama-server command line a sweep uses (the same GGUF, one
parallel slot per concurrent client, greedy requests come from the client).
"""

from __future__ import annotations

import os
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import httpx

LLAMA_SERVER = "llama-server"


def peer_bin_dir() -> Path:
    """$ADAFLASH_PEER_DIR/bin, else .peer/bin under the current directory (where `make peer` builds)."""
    return (Path(os.environ.get("ADAFLASH_PEER_DIR", ".peer")) / "bin").resolve()


def peer_env(bin_dir: Path) -> dict[str, str]:
    """The environment llama.cpp's binaries run in: their shared libraries beside them."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(bin_dir), env.get("LD_LIBRARY_PATH")) if p)
    return env


def require_binary(bin_dir: Path, name: str) -> Path:
    path = bin_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: build llama.cpp with `make peer` (see docs/deploy.md)")
    return path


@contextmanager
def launched_process(name: str, cmd: Sequence[str], health_url: str, log_path: Path, env: dict[str, str] | None = None,
                     timeout_s: float = 600) -> Iterator[subprocess.Popen]:
    """Run `cmd` (a server) with its output in `log_path`; yield once `health_url` answers 200, stop it on exit."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text(errors="replace")[-3000:]
                    raise RuntimeError(f"{name!r} exited with {proc.returncode} before it was healthy "
                                       f"(log {log_path}):\n{tail}")
                try:
                    if httpx.get(health_url, timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name!r} not healthy after {timeout_s:.0f} s (log {log_path})")
                time.sleep(1)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def llama_server_command(bin_dir: Path, args: Sequence[str], port: int, parallel: int, ctx_per_slot: int,
                         threads: int | None, model_gguf: Path | None) -> list[str]:
    """llama-server with `args`; adds the target GGUF (unless -m is given), slots, context and threads."""
    cmd = [str(require_binary(bin_dir, LLAMA_SERVER)), *args]
    if "-m" not in args and "--model" not in args:
        if model_gguf is None:
            raise ValueError("a llama-server peer needs -m GGUF in its arguments or a model GGUF")
        cmd += ["-m", str(model_gguf)]
    # -c is the total context, shared by the -np slots.
    cmd += ["--host", "127.0.0.1", "--port", str(port), "-np", str(parallel), "-c", str(parallel * ctx_per_slot)]
    if threads:
        cmd += ["-t", str(threads), "-tb", str(threads)]
    return cmd
