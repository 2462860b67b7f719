"""Where `make peer-src` / `make peer` put llama.cpp (override with ADAFLASH_PEER_DIR, e.g. to test the skips)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEER = Path(os.environ.get("ADAFLASH_PEER_DIR", REPO / ".peer"))
PEER_PYTHON = PEER / "venv" / "bin" / "python"
CONVERTER = PEER / "src" / "llama.cpp" / "convert_hf_to_gguf.py"
BIN = PEER / "bin"
