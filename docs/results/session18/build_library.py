"""Build the kernel library (packed.SOURCES) of this checkout, or of a git revision, into a shared object.

    python docs/results/session18/build_library.py OUT.so [REV]
"""
import subprocess, sys, tempfile
from pathlib import Path

from adaflash.models.kernels import packed

out = Path(sys.argv[1]).resolve()
if len(sys.argv) > 2:
    tmp = Path(tempfile.mkdtemp())
    root = Path(packed.__file__).parents[3]
    for src in (*packed.SOURCES, *packed.HEADERS):
        rel = src.relative_to(root)
        (tmp / src.name).write_bytes(
            subprocess.run(["git", "show", f"{sys.argv[2]}:{rel}"], check=True, capture_output=True).stdout)
    packed.build_library(out, tuple(tmp / s.name for s in packed.SOURCES))
else:
    packed.build_library(out)
