"""Faults, each done for real to a real `adaflash serve` or `adaflash train drafter` process (the embedded
SmolLM2-135M and its shipped drafters):

    .venv/bin/python benchmarks/reliability/faults.py --out docs/results/reliability/faults

- `sigkill-stream`: the server SIGKILLed while streams are mid-flight: every open stream ends closed, without
  `[DONE]` (none is passed off as complete); a restart serves again, each interrupted text a prefix of its answer.
- `corrupt`: a truncated drafter, length head or GGUF is refused at `serve` start, the message naming the file (no
  traceback); a hot swap (--watch-versions) to a truncated drafter is refused naming the file, and the incumbent
  keeps serving the same text.
- `sigkill-train`: a training run SIGKILLed mid-step after its first checkpoint resumes to the same fp32 weights as
  an unbroken run with the same seed.
- `full-disk`: the disk fills while a training run writes its second checkpoint (the output on a tmpfs, filled once
  the first checkpoint is written): the run stops naming the error and the intact checkpoint, which loads; once space
  is freed the same command resumes from it and ends at the unbroken run's weights.

A rerun with --only replaces those scenarios' rows and keeps the others. OUT.json and OUT.md hold the verdicts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from adaflash.evaluation.load_test import gauge
from adaflash.evaluation.peer import launched_process
from adaflash.models.drafters.checkpoint import WEIGHTS_FILE, load_drafter, publish_version
from adaflash.models.device.cpu import cpu_model
from adaflash.models.targets.registry import shipped_drafter, target_gguf
from adaflash.report import verdict_page, write_report

MODEL = "smollm2-135m"
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash map works, step by step.",
           "What is 48 * 17? Show your working.", "Describe the water cycle for a child."]
HEAD_FILE = "length_head.safetensors"


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads)}


def _serve_cmd(args, *serve_args: str) -> list[str]:
    return [sys.executable, "-m", "adaflash.cli", "serve", "--model", MODEL, "--port", str(args.port),
            "--max-batch", "4", "--max-len", "512", "--log-level", "warning", *serve_args]


def _served(args, name: str, *serve_args: str):
    """`adaflash serve` as a subprocess, yielding its Popen once /health answers (stopped on exit)."""
    return launched_process(name, _serve_cmd(args, *serve_args), f"http://127.0.0.1:{args.port}/health",
                            args.work / f"{name}.log", _env(args.threads), timeout_s=300)


def _chat(url: str, prompt: str, max_tokens: int) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0})


def _truncated(src: Path, dst: Path) -> Path:
    """A copy of `src` cut to half its bytes (an interrupted upload or copy)."""
    data = src.read_bytes()
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(data[: len(data) // 2])
    return dst


# ---- serving ------------------------------------------------------------------------------------------------------

async def _stream_until_killed(url: str, pid: int) -> tuple[list[dict], float]:
    """PROMPTS streamed at once; the server SIGKILLed once every stream has 16 characters. Each stream's text so far,
    how it ended and when."""
    first = [asyncio.Event() for _ in PROMPTS]

    async def one(i: int, client: httpx.AsyncClient) -> dict:
        body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 400,
                "temperature": 0, "stream": True}
        text, ending = [], "ended without [DONE]"
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                async for line in resp.aiter_lines():
                    if line == "data: [DONE]":
                        ending = "[DONE]"
                    elif line.startswith("data: "):
                        for choice in json.loads(line[6:]).get("choices", []):
                            text.append(choice.get("delta", {}).get("content") or "")
                        if len("".join(text)) >= 16:  # enough text that "a prefix of the answer" says something
                            first[i].set()
        except httpx.HTTPError as exc:
            ending = f"closed ({type(exc).__name__})"
        first[i].set()
        return {"text": "".join(text), "ending": ending, "ended_at": time.perf_counter()}

    async def kill() -> float:
        await asyncio.gather(*(e.wait() for e in first))
        os.kill(pid, signal.SIGKILL)
        return time.perf_counter()

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        *streams, killed_at = await asyncio.gather(*(one(i, client) for i in range(len(PROMPTS))), kill())
    return streams, killed_at


def sigkill_mid_stream(args) -> dict:
    url = f"http://127.0.0.1:{args.port}"
    with _served(args, "sigkill-stream") as proc:
        streams, killed_at = asyncio.run(_stream_until_killed(url, proc.pid))
        proc.wait()
    open_at_kill = [s for s in streams if s["ending"] != "[DONE]" or s["ended_at"] > killed_at]
    start = time.perf_counter()
    with _served(args, "sigkill-stream-restart"):
        restart_s = time.perf_counter() - start
        answers = [_chat(url, p, 400) for p in PROMPTS]
    served = [a.status_code == 200 for a in answers]
    prefixes = [a.json()["choices"][0]["message"]["content"].startswith(s["text"]) for a, s in zip(answers, streams)]
    closed = [s for s in open_at_kill if s["ending"] != "[DONE]"]
    passed = proc.returncode == -signal.SIGKILL and len(closed) == len(open_at_kill) > 0 and all(served) and all(prefixes)
    return {
        "fault": "SIGKILL to the server while 4 streams are mid-flight",
        "expected": "open streams end closed without [DONE]; a restart serves; interrupted text a prefix of the answer",
        "observed": f"{len(closed)} of {len(open_at_kill)} open streams closed without [DONE] "
                    f"({', '.join(sorted({s['ending'] for s in closed}))}); restart healthy in {restart_s:.1f} s, "
                    f"{sum(served)}/{len(PROMPTS)} answered 200, {sum(prefixes)}/{len(PROMPTS)} interrupted texts a prefix",
        "passed": passed,
        "details": {"streams": [{"chars_before_kill": len(s["text"]), "ending": s["ending"]} for s in streams],
                    "restart_to_healthy_s": round(restart_s, 1)},
    }


def _refused_at_start(args, name: str, *serve_args: str) -> dict:
    """`serve` with a bad file: its exit status and whether its message names `bad` without a traceback."""
    cmd = _serve_cmd(args, *serve_args[1:])
    try:
        run = subprocess.run(cmd, env=_env(args.threads), capture_output=True, text=True, timeout=300)
        output, rc = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired:
        output, rc = "still running after 300 s (it served the bad file)", None
    bad = serve_args[0]
    return {"case": name, "file": bad, "exit": rc, "names_file": bad in output, "traceback": "Traceback" in output,
            "message": next((line for line in output.splitlines() if line.startswith("error")), output[-300:]).strip()}


def _metric(url: str, name: str) -> float:
    value = gauge(httpx.get(f"{url}/metrics", timeout=30).text, name)
    return float("nan") if value is None else value


def _hot_swap_to_corrupt(args) -> dict:
    url, versions = f"http://127.0.0.1:{args.port}", args.work / "versions"
    publish_version(shipped_drafter(MODEL, "dflash"), versions)
    with _served(args, "hot-swap", "--watch-versions", str(versions)):
        before = _chat(url, PROMPTS[1], 48).json()["choices"][0]["message"]["content"]
        bad = args.work / "bad-version"
        shutil.copytree(shipped_drafter(MODEL, "dflash"), bad)
        _truncated(bad / WEIGHTS_FILE, bad / WEIGHTS_FILE)
        published = publish_version(bad, versions)
        deadline = time.monotonic() + 60
        while _metric(url, "adaflash_hot_swap_refused_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        after = _chat(url, PROMPTS[1], 48)
        refused = _metric(url, "adaflash_hot_swap_refused_total")
    log = (args.work / "hot-swap.log").read_text()
    return {"case": "hot swap to a truncated drafter", "file": str(published / WEIGHTS_FILE), "refused_total": refused,
            "names_file": str(published / WEIGHTS_FILE) in log or published.name in log,
            "still_serving": after.status_code == 200, "same_text": after.status_code == 200
            and after.json()["choices"][0]["message"]["content"] == before,
            "message": next((line for line in log.splitlines() if published.name in line), "").strip()}


def corrupt_artifacts(args) -> dict:
    drafter, adaflash = Path(shipped_drafter(MODEL, "dflash")), Path(shipped_drafter(MODEL, "adaflash"))
    bad_drafter, bad_head = args.work / "bad-drafter", args.work / "bad-head"
    shutil.copytree(drafter, bad_drafter)
    _truncated(drafter / WEIGHTS_FILE, bad_drafter / WEIGHTS_FILE)
    shutil.copytree(adaflash, bad_head)
    _truncated(adaflash / HEAD_FILE, bad_head / HEAD_FILE)
    bad_gguf = _truncated(target_gguf(MODEL), args.work / "truncated.gguf")
    cases = [
        _refused_at_start(args, "truncated drafter weights", str(bad_drafter / WEIGHTS_FILE), "--drafter", str(bad_drafter)),
        _refused_at_start(args, "truncated length head", str(bad_head / HEAD_FILE), "--method", "adaflash",
                          "--drafter", str(bad_head)),
        _refused_at_start(args, "truncated GGUF target", str(bad_gguf), "--model", str(bad_gguf), "--method", "ar"),
    ]
    swap = _hot_swap_to_corrupt(args)
    at_start = [c["exit"] not in (0, None) and c["names_file"] and not c["traceback"] for c in cases]
    swapped_ok = swap["refused_total"] == 1 and swap["names_file"] and swap["still_serving"] and swap["same_text"]
    return {
        "fault": "truncated drafter / length head / GGUF at start; a truncated drafter published to a serving server",
        "expected": "refused at load naming the file, no traceback; the hot swap refused naming it, the old drafter serving",
        "observed": f"{sum(at_start)}/{len(cases)} refused at start as expected; hot swap "
                    f"{'refused, the incumbent serving the same text' if swapped_ok else 'NOT as expected'}",
        "passed": all(at_start) and swapped_ok,
        "details": {"at_start": cases, "hot_swap": swap},
    }


# ---- training -----------------------------------------------------------------------------------------------------

def _train_setup(args) -> tuple[list[str], dict]:
    """Training data (a few real prompts' responses and the target's features) and a config continuing the shipped
    drafter for a few steps, checkpointing every 4: the command and the config."""
    data = args.work / "train-data"
    if not (data / "manifest.json").is_file():
        subprocess.run([sys.executable, "-m", "adaflash.cli", "data", "generate", "--out", str(data), "--model", MODEL,
                        "--mix", "gsm-symbolic:6,sharegpt-chat:6", "--capture-layers", "1,14,27", "--dtype", "fp32",
                        "--max-new-tokens", "64", "--max-prompt-tokens", "192", "--batch-size", "12"],
                       env=_env(args.threads), check=True, capture_output=True)
    config = {"data_dir": str(data), "model": MODEL, "init_from": str(shipped_drafter(MODEL, "dflash")),
              "mask_token_id": 16, "num_layers": 2, "block_size": 16, "target_layer_ids": [1, 14, 27],
              "draft_vocab_size": 4096, "lr": 1e-4, "warmup_frac": 0.1, "max_steps": 12, "sequences_per_step": 2,
              "anchors_per_sequence": 16, "seed": 1, "log_every": 4, "save_every": 4, "autocast_bf16": False}
    return [sys.executable, "-m", "adaflash.cli", "--threads", str(args.threads), "train", "drafter"], config


def _train(args, cmd: list[str], config: dict, out: Path, **popen) -> subprocess.Popen:
    cfg = out.with_suffix(".json")
    cfg.write_text(json.dumps({**config, "out_dir": str(out)}))
    return subprocess.Popen([*cmd, "--config", str(cfg)], env=_env(args.threads), **popen)


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_drafter(path, dtype=torch.float32).state_dict()


def _same_weights(a: Path, b: Path) -> bool:
    wa, wb = _weights(a), _weights(b)
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def _unbroken(args) -> tuple[list[str], dict, Path]:
    cmd, config = _train_setup(args)
    straight = args.work / "train-unbroken"
    if not (straight / "drafter").is_dir():
        assert _train(args, cmd, config, straight, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT).wait() == 0
    return cmd, config, straight


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)


def sigkill_mid_step(args) -> dict:
    cmd, config, straight = _unbroken(args)
    out = args.work / "train-killed"
    proc = _train(args, cmd, config, out, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    _wait_for(out / "checkpoint" / "trainer_state.pt", proc)
    time.sleep(1.5)  # into the next steps: the kill lands mid-step, not at a checkpoint boundary
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    state = out / "checkpoint" / "trainer_state.pt"
    killed_at = torch.load(state, weights_only=False)["step"] if state.is_file() else None
    resumed = _train(args, cmd, config, out, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT).wait()
    same = resumed == 0 and _same_weights(straight / "drafter", out / "drafter")
    return {
        "fault": "SIGKILL to `train drafter` mid-step, after its first checkpoint (12 steps, a checkpoint every 4)",
        "expected": "the same command resumes and ends at the unbroken run's fp32 weights, bit for bit",
        "observed": f"killed ({proc.returncode}) with the checkpoint at step {killed_at}; resumed (exit {resumed}); "
                    f"weights {'identical' if same else 'DIFFERENT'}",
        "passed": proc.returncode == -signal.SIGKILL and killed_at is not None and killed_at < config["max_steps"] and same,
    }


def full_disk(args) -> dict:
    cmd, config, straight = _unbroken(args)
    mount = args.work / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "tmpfs", str(mount)], capture_output=True).returncode:
        return {"fault": "disk full while writing a checkpoint", "expected": "-", "passed": False,
                "observed": "not run: mounting a tmpfs needs root"}
    try:
        out = mount / "run"
        out.mkdir()
        proc = _train(args, cmd, config, out, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        _wait_for(out / "checkpoint" / "trainer_state.pt", proc)
        filler = mount / "filler"
        with open(filler, "wb") as f:  # the disk fills up (another process's logs, say) before the next checkpoint
            try:
                while True:
                    f.write(b"\0" * (1 << 20))
                    f.flush()
            except OSError:
                pass
        output = proc.communicate()[0]
        said = re.search(r"error: [^\r\n]*", output)  # (tqdm's bar shares the line, ended by \r)
        message = said.group(0) if said else output[-400:]
        intact_step = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)["step"]
        loads = load_drafter(out / "checkpoint", dtype=torch.float32) is not None
        filler.unlink()
        resumed = _train(args, cmd, config, out, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT).wait()
        same = resumed == 0 and _same_weights(straight / "drafter", out / "drafter")
    finally:
        subprocess.run(["umount", str(mount)], check=False)
    says = "No space left" in message and str(out / "checkpoint") in message and "Traceback" not in output
    return {
        "fault": "the disk full (a 512 MB tmpfs filled) while `train drafter` writes its next checkpoint",
        "expected": "the run stops naming the error and the intact checkpoint, which loads; after freeing space the "
                    "same command resumes to the unbroken run's weights",
        "observed": f"exit {proc.returncode}: \"{message}\"; the checkpoint at step {intact_step} "
                    f"{'loads' if loads else 'does NOT load'}; resumed (exit {resumed}), weights "
                    f"{'identical' if same else 'DIFFERENT'} to the unbroken run's",
        "passed": proc.returncode not in (0, None) and says and loads and same,
    }


SCENARIOS = {"sigkill-stream": sigkill_mid_stream, "corrupt": corrupt_artifacts, "sigkill-train": sigkill_mid_step,
             "full-disk": full_disk}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--port", type=int, default=8441)
    p.add_argument("--work", type=Path, default=Path("runs/reliability/faults"), help="scratch: logs, checkpoints")
    p.add_argument("--out", type=Path, default=Path("docs/results/reliability/faults"), help="writes OUT.json, OUT.md")
    args = p.parse_args(argv)
    names = args.only.split(",")
    if unknown := set(names) - set(SCENARIOS):
        p.error(f"unknown scenarios {sorted(unknown)}; expected {', '.join(SCENARIOS)}")
    args.work.mkdir(parents=True, exist_ok=True)
    for stale in ("versions", "bad-version", "bad-drafter", "bad-head", "train-killed", "small-disk"):
        shutil.rmtree(args.work / stale, ignore_errors=True)
    out_json = args.out.with_suffix(".json")
    results = json.loads(out_json.read_text())["results"] if out_json.is_file() else {}
    for name in names:
        start = time.perf_counter()
        results[name] = {**SCENARIOS[name](args), "seconds": round(time.perf_counter() - start, 1)}
        print(f"{name}: {'pass' if results[name]['passed'] else 'FAIL'}: {results[name]['observed']}", flush=True)
    results = {name: results[name] for name in SCENARIOS if name in results}
    command = "python benchmarks/reliability/faults.py " + " ".join(sys.argv[1:] if argv is None else argv)
    machine = f"{cpu_model()}, {args.threads} threads, fp32 (serve's auto on this CPU); clients on the same cores"
    write_report(args.out, {"command": command, "machine": machine, "results": results},
                 verdict_page("Faults", command, f"Machine: {machine}.", results))
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
