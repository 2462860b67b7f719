"""`make test` as CI runs it: a fresh clone of HEAD, an empty user cache, nothing else on the cores. Times the install
and the suite apart and keeps pytest's slowest tests.

    python3 benchmarks/testing/suite_time.py --out docs/results/testing/suite_time

Stdlib only (it runs before any virtual environment exists). The clone is made in a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SLOWEST = 40


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def timed(cmd: list[str], cwd: Path, env: dict, log: Path) -> tuple[int, float]:
    start = time.monotonic()
    with open(log, "w") as out:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return rc, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="docs/results/testing/suite_time")
    args = ap.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory(prefix="adaflash-fresh-") as tmp:
        clone, cache = Path(tmp) / "clone", Path(tmp) / "cache"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        env = dict(os.environ, ADAFLASH_CACHE=str(cache), PYTEST_ADDOPTS=f"--durations={SLOWEST}")
        install_rc, install_s = timed(["make", "install"], clone, env, Path(tmp) / "install.log")
        test_rc, test_s = timed(["make", "test"], clone, env, Path(tmp) / "test.log")
        log = (Path(tmp) / "test.log").read_text()
    slowest = [{"seconds": float(m.group(1)), "phase": m.group(2), "test": m.group(3)}
               for m in re.finditer(r"^\s*([\d.]+)s (call|setup|teardown)\s+(\S+)$", log, re.M)]
    summary = next((line.strip("= ") for line in reversed(log.splitlines()) if " in " in line and "passed" in line), "")
    report = {"command": f"python3 benchmarks/testing/suite_time.py --out {args.out}",
              "machine": f"{cpu_model()}, {os.cpu_count()} CPUs, nothing else running", "commit": commit,
              "install_s": round(install_s, 1), "pytest_s": round(test_s, 1), "total_s": round(install_s + test_s, 1),
              "summary": summary, "passed": install_rc == 0 and test_rc == 0, "slowest": slowest}
    out = ROOT / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    lines = [f"`make test` on a fresh clone of {commit} with an empty user cache: install {report['install_s']:.0f} s, "
             f"the suite {report['pytest_s']:.0f} s, **{report['total_s']:.0f} s** in all ({summary}).", "",
             f"Machine: {report['machine']}. `{report['command']}`", "", f"The slowest {len(slowest)}:", "",
             "| seconds | phase | test |", "|---|---|---|"]
    lines += [f"| {r['seconds']:.2f} | {r['phase']} | `{r['test']}` |" for r in slowest]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[:3]))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
