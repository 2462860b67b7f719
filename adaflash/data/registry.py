"""The table of prompt sets: `load_prompts(name, split)` and `list_datasets()`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from adaflash.data import champ, gsm_symbolic, humaneval, mtbench, sharegpt
from adaflash.data.prompt import DatasetUnavailableError, Prompt
from adaflash.data.splits import EVAL, SPLITS, TRAIN, check_split

EVAL_BENCHMARKS = ("gsm8k", "champ", "humaneval", "sharegpt-code", "mt-bench", "sharegpt-chat", "mgsm")


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    domain: str
    split_sizes: dict[str, int | None]  # None: unlimited (a generator); {} if the package is missing
    package: str  # pip requirement that provides the data
    description: str
    available: bool = True


@dataclass(frozen=True)
class _Source:
    name: str
    domain: str
    package: str
    description: str
    splits: tuple[str, ...]
    # load(split, multi_turn, seed, limit) -> prompts
    load: Callable[[str, bool, int, int | None], list[Prompt]]
    unbounded: bool = False  # a generator: needs a limit, has no fixed size


def _gsm_symbolic(split: str, multi_turn: bool, seed: int, limit: int | None) -> list[Prompt]:
    if limit is None:
        raise ValueError("gsm-symbolic is an endless generator: pass limit=N (or use GSMSymbolicStream)")
    return gsm_symbolic.GSMSymbolicStream(seed, split).take(limit)


def _mgsm_symbolic(split: str, multi_turn: bool, seed: int, limit: int | None) -> list[Prompt]:
    if limit is None:
        raise ValueError("mgsm-symbolic is an endless generator: pass limit=N")
    return gsm_symbolic.GSMSymbolicStream(seed, split, gsm_symbolic.MULTILINGUAL_LANGS).take(limit)


_SOURCES = {
    s.name: s
    for s in (
        _Source(
            "gsm8k", "math", gsm_symbolic.PIP_SPEC,
            "GSM8K test originals behind the GSM-Symbolic templates, split by template id",
            SPLITS, lambda split, mt, seed, limit: gsm_symbolic.load_gsm8k(split),
        ),
        _Source(
            "gsm-symbolic", "math", gsm_symbolic.PIP_SPEC,
            "fresh GSM-Symbolic variants from train templates only (seeded generator)",
            (TRAIN,), _gsm_symbolic, unbounded=True,
        ),
        _Source(
            "mgsm", "multilingual", gsm_symbolic.PIP_SPEC,
            f"GSM8K originals translated ({len(gsm_symbolic.MULTILINGUAL_LANGS)} languages), split by template id",
            SPLITS, lambda split, mt, seed, limit: gsm_symbolic.load_mgsm(split),
        ),
        _Source(
            "mgsm-symbolic", "multilingual", gsm_symbolic.PIP_SPEC,
            "fresh GSM-Symbolic variants in the same languages, train templates only (seeded generator)",
            (TRAIN,), _mgsm_symbolic, unbounded=True,
        ),
        _Source(
            "champ", "math", champ.PIP_SPEC, "CHAMP competition math problems (5 categories)",
            SPLITS, lambda split, mt, seed, limit: champ.load_champ(split),
        ),
        _Source(
            "humaneval", "code", humaneval.PIP_SPEC, "HumanEval Python function completion (all 164 in eval)",
            humaneval.SPLITS, lambda split, mt, seed, limit: humaneval.load_humaneval(split),
        ),
        _Source(
            "sharegpt-code", "code", sharegpt.PIP_SPEC, "ShareGPT conversations with code blocks, first human turn",
            SPLITS, lambda split, mt, seed, limit: sharegpt.load_sharegpt("code", split, mt),
        ),
        _Source(
            "mt-bench", "chat", mtbench.PIP_SPEC, "MT-Bench, 80 questions in 8 categories (turn 2 as followup)",
            mtbench.SPLITS, lambda split, mt, seed, limit: mtbench.load_mtbench(split, mt),
        ),
        _Source(
            "sharegpt-chat", "chat", sharegpt.PIP_SPEC, "ShareGPT conversations without code, first human turn",
            SPLITS, lambda split, mt, seed, limit: sharegpt.load_sharegpt("chat", split, mt),
        ),
    )
}  # fmt: skip


def dataset_names() -> tuple[str, ...]:
    return tuple(_SOURCES)


def _source(name: str) -> _Source:
    if name not in _SOURCES:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(_SOURCES)}")
    return _SOURCES[name]


def load_prompts(
    name: str, split: str = EVAL, limit: int | None = None, *, multi_turn: bool = False, seed: int = 0
) -> list[Prompt]:
    """The prompts of dataset `name` in `split` ("eval" or "train"), the first `limit` of them if given.

    The order is fixed (source order, or hash order for the large sets), so a limit is reproducible.
    `multi_turn` fills `Prompt.followups` (MT-Bench, ShareGPT); `seed` drives the gsm-symbolic generator.
    Raises `DatasetUnavailableError` (with the pip command) if the source package is not installed.
    """
    source = _source(name)
    check_split(split, source.splits, dataset=name)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    prompts = source.load(split, multi_turn, seed, limit)
    return prompts if limit is None else prompts[:limit]


def list_datasets() -> list[DatasetInfo]:
    """Every registered dataset with its split sizes (loads each once; ShareGPT is cached after the first)."""
    infos = []
    for s in _SOURCES.values():
        try:
            if s.unbounded:
                gsm_symbolic.load_templates()  # only checks the package is there
                sizes: dict[str, int | None] = {split: None for split in s.splits}
            else:
                sizes = {split: len(s.load(split, False, 0, None)) for split in s.splits}
            available = True
        except DatasetUnavailableError:
            sizes, available = {}, False
        infos.append(DatasetInfo(s.name, s.domain, sizes, s.package, s.description, available))
    return infos
