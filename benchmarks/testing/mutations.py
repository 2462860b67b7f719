"""docs/testing.md's table of core promises, proved by mutation: each promise's fault is put into a copy of the
repository (one line of the product changed), its guard tests run there, and the fault must turn them red.

    python benchmarks/testing/mutations.py --out docs/results/testing/mutations

A row passes when the guard tests pass on the clean copy and fail with the fault in; the JSON keeps each run's
pytest summary line. The copy is `git worktree`-free: the tracked files are copied to a temporary folder, which the
guard tests import first (PYTHONPATH), so the checkout is never touched.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Fault:
    promise: str  # the row of docs/testing.md's table
    file: str  # the product file faulted
    line: str  # an exact line (stripped) of that file
    faulty: str  # what it becomes (same indentation)
    guards: tuple[str, ...]  # pytest node ids or files that must go red


FAULTS = (
    Fault("greedy is lossless", "adaflash/speculative/verify.py",
          "while n < k and drafts[d + n] == targets[t + n]:", "while n < k:  # FAULT: every draft accepted",
          ("tests/speculative/test_reference.py", "tests/engine/test_engine.py")),
    Fault("sampling keeps the target's law", "adaflash/speculative/verify.py",
          "residual = (p_next - q_next * rejected[:, None].to(p_next.dtype)).clamp_min(0.0)",
          "residual = p_next.clamp_min(0.0)  # FAULT: the residual ignores q",
          ("tests/speculative/test_verify.py",)),
    Fault("the engine is the reference loop", "adaflash/engine/engine.py",
          "results[i] = (int(res.num_accepted[j]), int(res.next_tokens[j]))",
          "results[i] = (int(res.num_accepted[j]), int(res.next_tokens[0]))  # FAULT: a batch's first token for all",
          ("tests/engine/test_engine.py",)),
    Fault("the runtime is transformers", "adaflash/models/targets/config.py",
          "rope_theta=rope_theta_of(cfg),", "rope_theta=rope_theta_of(cfg) * 2,  # FAULT: another RoPE base",
          ("tests/models/test_target.py",)),
    Fault("OpenAI errors", "adaflash/server/server.py",
          'type="invalid_request_error", param=loc[0] if loc else None)',
          'type="invalid_request_error", param=None)  # FAULT: the bad field not named',
          ("tests/server/test_server.py",)),
    Fault("training resumes", "adaflash/training/checkpoint.py",
          "old.rename(ckpt)", "pass  # FAULT: the previous checkpoint not put back",
          ("tests/training/test_trainer.py::test_a_kill_between_the_checkpoint_renames_resumes_from_the_previous_checkpoint",
           "tests/training/test_trainer.py::test_sigkill_mid_run_resumes_to_the_unbroken_runs_weights")),
    Fault("DDP = one process", "adaflash/training/trainer.py",
          "sync = j == len(mine) - 1 or not distributed", "sync = not distributed  # FAULT: gradients never all-reduced",
          ("tests/training/test_trainer.py::test_torchrun_two_processes_matches_single_process",)),
)


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src, dst = ROOT / name.decode(), dest / name.decode()
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)


def apply(tree: Path, fault: Fault) -> None:
    path = tree / fault.file
    lines = path.read_text().split("\n")
    hits = [i for i, line in enumerate(lines) if line.strip() == fault.line]
    if len(hits) != 1:
        raise SystemExit(f"{fault.file}: the line {fault.line!r} is found {len(hits)} times, not once: update FAULTS")
    i = hits[0]
    lines[i] = lines[i][: len(lines[i]) - len(lines[i].lstrip())] + fault.faulty
    path.write_text("\n".join(lines))


def run_guards(tree: Path, guards: tuple[str, ...]) -> tuple[int, str, float]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "--timeout=600",
                           *guards], cwd=tree, env=env, capture_output=True, text=True)
    summary = next((line for line in reversed(done.stdout.splitlines()) if line.strip()), "")
    return done.returncode, summary.strip("= "), time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/testing/mutations")
    args = ap.parse_args(argv)
    rows = []
    for fault in FAULTS:
        with tempfile.TemporaryDirectory(prefix="adaflash-mutation-") as tmp:
            tree = Path(tmp)
            copy_tree(tree)
            clean_rc, clean, clean_s = run_guards(tree, fault.guards)
            apply(tree, fault)
            faulty_rc, faulty, faulty_s = run_guards(tree, fault.guards)
        row = {"promise": fault.promise, "file": fault.file, "fault": fault.faulty.split("# FAULT: ")[1],
               "guards": list(fault.guards), "clean": clean, "faulted": faulty,
               "caught": clean_rc == 0 and faulty_rc == 1, "seconds": round(clean_s + faulty_s, 1)}
        rows.append(row)
        print(f"{'caught' if row['caught'] else 'NOT CAUGHT'}: {fault.promise}: {row['fault']} | clean: {clean} | "
              f"faulted: {faulty}", flush=True)
    report = {"command": "python benchmarks/testing/mutations.py --out " + args.out,
              "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs", "rows": rows,
              "caught": sum(r["caught"] for r in rows), "faults": len(rows)}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"Mutations of docs/testing.md's table: {report['caught']} of {report['faults']} caught.", "",
             f"`{report['command']}`", "", "| promise | fault | guards | clean | faulted | caught |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['promise']} | `{r['file']}`: {r['fault']} | {', '.join(r['guards'])} | {r['clean']} | "
                     f"{r['faulted']} | {'yes' if r['caught'] else 'NO'} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0 if report["caught"] == report["faults"] else 1


if __name__ == "__main__":
    sys.exit(main())
