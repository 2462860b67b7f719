"""The target's vocabulary in a DFlash GGUF, written the way llama.cpp's converter writes it.

llama.cpp loads a DFlash drafter as a model of its own, vocabulary included, and refuses to speculate unless
the draft vocabulary matches the target's (common/speculative.cpp `common_speculative_are_compatible`: same
vocab type, same add_bos/add_eos and BOS/EOS ids, sizes within 128, equal token texts from id 5 on). Its
converter (`convert_hf_to_gguf.py`, class `DFlashModel.set_vocab`) therefore writes the *target's* tokenizer
into the drafter GGUF, through the target family's own vocab handler. This module does the same for the
byte-level BPE tokenizers (`tokenizer.json`) of the families our runtime loads (Llama, Qwen2, Qwen3), with the
registry's `gguf` package, following llama.cpp's conventions (`conversion/base.py` `get_vocab_base`,
`_set_vocab_gpt2`; `conversion/llama.py` `LlamaModel.set_vocab`; `gguf-py/gguf/vocab.py` `SpecialVocab`):

- `tokenizer.ggml.model = "gpt2"`; tokens in id order, `[PAD{i}]` (UNUSED) for ids the tokenizer lacks; added
  tokens are CONTROL if special (or shaped like `<|...|>`), else USER_DEFINED; everything else NORMAL.
- `tokenizer.ggml.pre`: llama.cpp names the pre-tokenizer by the sha256 of the token ids of a fixed probe text
  (`get_vocab_base_pre`). The probe and the hashes of the families we support are below; another target needs
  `--tokenizer-pre NAME` (a name from llama.cpp's src/llama-vocab.cpp) or llama.cpp's own converter.
- merges, special token ids, add_bos/add_eos and the chat template from `gguf.SpecialVocab`, plus the two
  rules of the converter's newer tree the registry's `gguf` lacks: a ByteLevel post-processor means no BOS/EOS
  is added, and a Llama target with a 49152-token vocabulary (SmolLM2, Granite small) gets add_bos_token=false.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

# llama.cpp's probe (conversion/base.py, get_vocab_base_pre `chktxt`), checked against its sha256 below.
PROBE_TEXT = (
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 "
    "3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ "
    "------======= нещо на Български ''''''```````\"\"\"\"......!!!!!!?????? I've been 'told he's there, 'RE you "
    "sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL"
)
PROBE_SHA256 = "a36179c1e2b1cfcfbfad1dc779addad2ffc778201e4cf0d538bddeafa2c526da"

# sha256(str(tokenizer.encode(PROBE_TEXT))) -> llama.cpp pre-tokenizer name (llama.cpp 11434's table, the
# entries for tokenizers of the Llama / Qwen2 / Qwen3 families).
PRE_TOKENIZER_BY_HASH = {
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM(2)
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen/Qwen3-Embedding-0.6B
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",  # R1-Distill-Qwen
}

# gguf TokenType values (gguf-py/gguf/constants.py)
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5

CONVERTER_HINT = (
    "convert it with llama.cpp's own converter instead: `make peer-src`, then `.peer/venv/bin/python "
    ".peer/src/llama.cpp/convert_hf_to_gguf.py DRAFTER_DIR --target-model-dir TARGET_DIR --outfile drafter.gguf`"
)


def _check_probe() -> None:
    if hashlib.sha256(PROBE_TEXT.encode()).hexdigest() != PROBE_SHA256:
        raise AssertionError("PROBE_TEXT differs from llama.cpp's probe text")


def read_tokenizer_json(target_dir: Path) -> dict[str, Any]:
    """The target's tokenizer.json, if it is a byte-level BPE tokenizer this module can write; else a clear error."""
    path = target_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: a DFlash GGUF carries the target's vocabulary (llama.cpp checks it against the "
            "target's), so the target directory needs its tokenizer.json"
        )
    try:
        tokenizer = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    model = tokenizer.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback", False) or (target_dir / "tokenizer.model").is_file():
        raise ValueError(
            f"{path}: only byte-level BPE tokenizers (llama.cpp's 'gpt2' vocab type) can be exported here, this one "
            f"is model type {model.get('type')!r}, byte_fallback={model.get('byte_fallback')}"
            f"{' with a SentencePiece tokenizer.model' if (target_dir / 'tokenizer.model').is_file() else ''}; "
            + CONVERTER_HINT
        )
    return tokenizer


def pre_tokenizer_name(tokenizer, tokenizer_json_path: Path, override: str | None = None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for this tokenizer: looked up by the probe hash, or `override`."""
    if override:
        return override
    _check_probe()
    digest = hashlib.sha256(str(tokenizer.encode(PROBE_TEXT)).encode()).hexdigest()
    name = PRE_TOKENIZER_BY_HASH.get(digest)
    if name is None:
        raise ValueError(
            f"{tokenizer_json_path}: llama.cpp's pre-tokenizer for this tokenizer is not known here (probe hash "
            f"{digest}); pass --tokenizer-pre NAME with the name llama.cpp uses for it, or " + CONVERTER_HINT
        )
    return name


def _looks_special(token: str) -> bool:
    """llama.cpp's `does_token_look_special`: added tokens some models forget to mark as special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def vocab_tokens(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """Token texts and types in id order, as the converter's `get_vocab_base` lists them."""
    vocab = tokenizer.get_vocab()
    if vocab and max(vocab.values()) >= vocab_size:
        raise ValueError(f"the tokenizer has ids up to {max(vocab.values())}, beyond the model's vocab_size {vocab_size}")
    reverse = {i: t for t, i in vocab.items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
            continue
        token = reverse[i]
        if token in added:
            if not decoder[i].normalized:  # llama.cpp takes added tokens pre-normalised
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[i].special or _looks_special(token):
                types.append(CONTROL)
            else:
                token = token.replace("\u2581", " ")
                types.append(USER_DEFINED)
        else:
            types.append(NORMAL)
        tokens.append(token)
    return tokens, types


def _post_processors(tokenizer_json: dict[str, Any]) -> list[dict[str, Any]]:
    post = tokenizer_json.get("post_processor") or {}
    return list(post.get("processors", [post])) if post else []


def write_target_vocab(writer, target_dir: Path, vocab_size: int, target_arch: str, mask_token_id: int,
                       tokenizer_pre: str | None = None) -> str:
    """Add the target's tokenizer (and the drafter's mask token id) to `writer`; returns the pre-tokenizer name."""
    import gguf

    from adaflash.models.targets.registry import load_tokenizer

    tokenizer_json = read_tokenizer_json(target_dir)
    tokenizer = load_tokenizer(target_dir)
    is_llama = target_arch == "LlamaForCausalLM"
    if is_llama:  # LlamaModel.set_vocab reads add_prefix_space first
        config_file = target_dir / "tokenizer_config.json"
        tokenizer_config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        if tokenizer_config.get("add_prefix_space") is not None:
            writer.add_add_space_prefix(bool(tokenizer_config["add_prefix_space"]))
    pre = pre_tokenizer_name(tokenizer, target_dir / "tokenizer.json", tokenizer_pre)
    tokens, types = vocab_tokens(tokenizer, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)

    special = gguf.SpecialVocab(target_dir, load_merges=True)
    if any(p.get("type") == "ByteLevel" for p in _post_processors(tokenizer_json)):
        special.add_special_token.setdefault("bos", False)
        special.add_special_token.setdefault("eos", False)
    if is_llama and vocab_size == 49152:
        special.add_special_token["bos"] = False
    special.special_token_ids.pop("mask", None)  # the drafter's mask id is written below, as DFlashModel does
    special.add_to_gguf(writer, quiet=True)
    writer.add_mask_token_id(mask_token_id)
    return pre
