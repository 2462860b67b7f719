"""SGLang's per-request `meta_info` (`"return_meta_info": true`): token counts, what ended the text, and the
speculative-decoding statistics of the request, under SGLang's names, so clients written for SGLang (z-lab's DFlash
benchmark reads spec_accept_length and spec_verify_ct) read this server too.

The statistics cover exactly the outputs the server handed on: the engine yields one output per pass over a request
(its prefill, then one per decode pass), and appends that pass's accept / draft counts to the request before the
output leaves the engine thread; so the first `passes` entries of those lists are complete when read on the event
loop, and a request cut short by a stop string is counted up to its last token sent, not beyond.
"""

from __future__ import annotations

from adaflash.engine.request import Request
from adaflash.server.protocol import FinishInfo, MetaInfo


def finish_info(finish_reason: str, stop_string: str | None, token_ids: list[int], max_tokens: int) -> FinishInfo:
    if finish_reason == "length":
        return FinishInfo(type="length", length=max_tokens)
    # A stop string (cut from the text) or the stop token that ended the request (the last one generated).
    return FinishInfo(type="stop", matched=stop_string if stop_string is not None else (token_ids[-1] if token_ids else None))


def meta_info(request: Request, outputs: int, prompt_tokens: int, completion_tokens: int, finish: FinishInfo,
              latency_s: float, max_verified: int) -> MetaInfo:
    """`outputs`: engine outputs the server read for the request (the prefill's included). `max_verified`: drafts one
    pass may verify (0: plain decoding, which SGLang reports without spec_* fields)."""
    meta = MetaInfo(id=request.request_id, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                    finish_reason=finish, e2e_latency=round(latency_s, 6))
    if max_verified <= 0:
        return meta
    passes = max(outputs - 1, 0)
    accepted = [n - 1 for n in request.accept_lengths[:passes]]  # the bonus token is the target's own
    proposed = sum(request.draft_lengths[:passes])
    histogram = [0] * (max(max_verified, *accepted, 0) + 1)
    for a in accepted:
        histogram[a] += 1
    meta.spec_verify_ct = passes
    meta.spec_num_proposed_drafts = proposed
    meta.spec_num_correct_drafts = sum(accepted)
    meta.spec_correct_drafts_histogram = histogram
    if passes:
        meta.spec_accept_length = completion_tokens / passes
    if proposed:
        meta.spec_accept_rate = sum(accepted) / proposed
    return meta
