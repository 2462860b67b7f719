"""ShareGPT: record-by-record decoding of the truncated file, slicing, and the JSONL cache."""

import json

from adaflash.data import load_prompts, sharegpt


def test_iter_records_stops_at_truncated_tail():
    records = [{"id": "a_0", "conversations": []}, {"id": "b_1", "conversations": [{"from": "human", "value": "x"}]}]
    text = json.dumps(records, indent=2)
    assert list(sharegpt.iter_records(text)) == records
    truncated = text[: text.rindex('"x"') + 2]  # cut inside the last record
    assert list(sharegpt.iter_records(truncated)) == records[:1]


def test_candidate_filtering():
    human, gpt = "human", "gpt"

    def conv(*turns, rid="c_0"):
        return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}

    assert sharegpt._candidate(conv((gpt, "hello"), (human, "hi"))) is None  # must start with a human turn
    assert sharegpt._candidate(conv((human, "   "))) is None
    assert sharegpt._candidate(conv((human, "x" * (sharegpt.MAX_PROMPT_CHARS + 1)))) is None
    c = sharegpt._candidate(conv((human, " Q1 "), (gpt, "```py\nprint(1)\n```"), (human, "Q2"), (gpt, "ok")))
    assert c == {"id": "c_0", "first": "Q1", "followups": ["Q2"], "code": True}
    assert not sharegpt._candidate(conv((human, "Q"), (gpt, "A")))["code"]


def test_conversation_key():
    assert sharegpt.conversation_key("sharegpt/QWJhYvA_0") == "QWJhYvA"
    assert sharegpt.conversation_key("sharegpt/QWJhYvA_12") == "QWJhYvA"
    assert sharegpt.conversation_key("sharegpt/plain") == "plain"


def test_parse_matches_cached_slices(sharegpt_parsed):
    by_id = {p.id: p for p in sharegpt_parsed}
    assert 9000 < len(by_id) == len(sharegpt_parsed) < 11200  # ~11.1K human-first, minus duplicates
    for name in ("sharegpt-code", "sharegpt-chat"):
        for split in ("eval", "train"):
            for p in load_prompts(name, split, multi_turn=True):
                assert by_id[p.id] == p  # the cache round-trips exactly
    loaded = sum(len(load_prompts(n, s)) for n in ("sharegpt-code", "sharegpt-chat") for s in ("eval", "train"))
    assert loaded == len(sharegpt_parsed)


def test_slices(sharegpt_parsed):
    code = [p for p in sharegpt_parsed if p.dataset == "sharegpt-code"]
    chat = [p for p in sharegpt_parsed if p.dataset == "sharegpt-chat"]
    assert all(p.domain == "code" for p in code) and all(p.domain == "chat" for p in chat)
    assert 2000 < len(code) < len(chat)

    # Requests that mention programming are far more common in the code slice.
    def share(ps):
        return sum("python" in p.text.lower() or "function" in p.text.lower() for p in ps) / len(ps)

    assert share(code) > 2 * share(chat)
    assert all(len(p.text) <= sharegpt.MAX_PROMPT_CHARS for p in sharegpt_parsed)
    assert len({sharegpt._normalized(p.text) for p in sharegpt_parsed}) == len(sharegpt_parsed)
