"""Hooks for `schemathesis run` against a live `adaflash serve` (SCHEMATHESIS_HOOKS=tests.server.schemathesis_hooks):
the one failure dropped is a schema-valid body refused 400 context_length_exceeded where its tokens, counted here
with the served model's own tokenizer and chat template, really exceed the context the server names. Every other
failure stands; the CLI reports how many it dropped.

ADAFLASH_CONTRACT_MODEL: the model the server serves (registry name or checkpoint dir; default smollm2-135m).
"""

from __future__ import annotations

import functools
import json
import os

import schemathesis

from tests.server.contract import CONTEXT, is_context_refusal, overflows_context


@functools.cache
def _codec():
    from transformers import AutoTokenizer

    from adaflash.models.targets.config import TransformerConfig
    from adaflash.models.targets.registry import resolve_target
    from adaflash.models.targets.text_codec import TextCodec

    path = resolve_target(os.environ.get("ADAFLASH_CONTRACT_MODEL", "smollm2-135m"))
    return TextCodec(AutoTokenizer.from_pretrained(path), TransformerConfig.from_dir(path).eos_token_ids)


@schemathesis.hook
def filter_failure(context, failure, case, response) -> bool:
    """Keep the failure unless it is a verified context overflow."""
    try:
        payload = json.loads(response.content)
    except ValueError:
        return True
    check = "positive_data_acceptance" if type(failure).__name__ == "RejectedPositiveData" else ""
    if not is_context_refusal(check, response.status_code, payload):
        return True
    stated = CONTEXT.search(payload["error"]["message"])
    return not (stated and overflows_context(case.path, case.body, _codec(), int(stated.group(1))))
