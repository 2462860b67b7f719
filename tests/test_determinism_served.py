"""Greedy output does not depend on the run, through the server: a policy's server equals the AR server, every prompt
sent at once, twice (the second round reuses cached prompt prefixes). The fresh-process runs are
tests/test_determinism.py's."""

from __future__ import annotations

import pytest

from adaflash.data import load_prompts
from adaflash.evaluation.determinism import served_runs
from adaflash.models.kernels import packed
from tests.helpers import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(packed.library() is None, reason="int8 needs our CPU kernels (AVX2 and a compiler)")]

MAX_NEW = 40


def test_int8_servers_equal_the_ar_server(smollm2_dir, tmp_path):
    prompts = [load_prompts(name, "eval", limit=1)[0].messages for name in ("gsm8k", "humaneval", "mt-bench")]
    report = served_runs(prompts, ["throughput"], ["int8"], MAX_NEW, tmp_path, port=free_port(), log=lambda _: None)
    assert report["int8"] == {"ar": [[], []], "throughput": [[], []]}
