"""User prompt files (`read_prompts_file`)."""

import json

import pytest

from adaflash.data import Prompt, read_prompts_file


def _write(tmp_path, lines, name="mine.jsonl"):
    path = tmp_path / name
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines) + "\n")
    return path


def test_good_file(tmp_path):
    path = _write(
        tmp_path,
        [
            {"prompt": "What is 2+2?", "domain": "math", "id": "q1", "reference": "4"},
            "",
            {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]},
            {"prompt": "Write a loop.", "domain": "code"},
        ],
    )
    prompts = read_prompts_file(path)
    assert [p.id for p in prompts] == ["q1", "mine/3", "mine/4"]
    assert prompts[0] == Prompt("q1", "math", "mine", ({"role": "user", "content": "What is 2+2?"},), reference="4")
    assert prompts[1].domain == "chat" and [m["role"] for m in prompts[1].messages] == ["system", "user"]
    assert prompts[2].domain == "code" and prompts[2].dataset == "mine"
    assert read_prompts_file(str(path)) == prompts


@pytest.mark.parametrize(
    "bad, message",
    [
        ('{"prompt": "x",}', "Expecting property name"),
        ({"text": "no prompt key"}, "prompt.*messages"),
        ({"messages": []}, "non-empty"),
        ({"prompt": ""}, "non-empty"),
        ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, "not both"),
        ({"messages": [{"role": "user"}]}, "role.*content"),
        ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, "last message"),
        ({"messages": [{"role": "wizard", "content": "q"}]}, "role"),
        ({"prompt": "x", "domain": ""}, "domain"),
        ({"prompt": "x", "domain": 7}, "domain"),
        ({"prompt": "x", "id": "q1"}, "duplicate id"),
        ('["a list"]', "JSON object"),
    ],
)
def test_bad_line_names_file_and_line(tmp_path, bad, message):
    path = _write(tmp_path, [{"prompt": "fine", "id": "q1"}, bad])
    with pytest.raises(ValueError, match=message) as info:
        read_prompts_file(path)
    assert f"{path}:2:" in str(info.value)


def test_any_domain_label_is_kept(tmp_path):
    path = _write(tmp_path, [{"prompt": "Wie viel ist 2+2?", "domain": "multilingual"}, {"prompt": "a verse", "domain": "poetry"}])
    assert [p.domain for p in read_prompts_file(path)] == ["multilingual", "poetry"]
