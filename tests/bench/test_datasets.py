"""Dataset generators: lengths within range, shared-prefix structure, jsonl parsing (no tokenizer needed)."""

import json

import pytest

from steploop.bench.datasets import jsonl_dataset, random_dataset, shared_prefix_dataset


class FakeTokenizer:
    """Ids 0..999 special-free; decode joins 't<id>' words, encode splits them back."""
    all_special_ids = (0,)

    def __len__(self):
        return 3000

    def decode(self, ids):
        return " ".join(f"t{i}" for i in ids)

    def encode(self, text, add_special_tokens=False):
        return [int(w[1:]) for w in text.split()]


def test_random_lengths_within_range_and_seeded():
    reqs = random_dataset(200, 100, 20, range_ratio=0.5, seed=1)
    assert len(reqs) == 200
    assert all(50 <= r.prompt_len <= 150 and 10 <= r.output_len <= 30 for r in reqs)
    assert len({r.prompt_len for r in reqs}) > 20              # actually spread
    assert all(len(r.prompt.split()) == r.prompt_len for r in reqs)   # words: one per token
    again = random_dataset(200, 100, 20, range_ratio=0.5, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]


def test_random_fixed_lengths_and_token_ids():
    reqs = random_dataset(10, 64, 8, tokenizer=FakeTokenizer(), as_ids=True)
    assert all(isinstance(r.prompt, list) and len(r.prompt) == 64 and r.output_len == 8 for r in reqs)
    assert all(1000 <= t < 3000 for r in reqs for t in r.prompt)   # no special or low ids
    text = random_dataset(3, 16, 4, tokenizer=FakeTokenizer())
    assert all(FakeTokenizer().encode(r.prompt) == r.token_ids for r in text)


def test_bad_range_ratio():
    with pytest.raises(ValueError):
        random_dataset(1, 10, 10, range_ratio=1.0)


def test_shared_prefix_structure():
    reqs = shared_prefix_dataset(3, 4, prefix_len=32, suffix_len=8, output_len=5, tokenizer=FakeTokenizer(),
                                 as_ids=True, seed=2)
    assert len(reqs) == 12 and all(r.prompt_len == 40 and r.output_len == 5 for r in reqs)
    prefixes = {tuple(r.prompt[:32]) for r in reqs}
    assert len(prefixes) == 3
    for p in prefixes:
        group = [r for r in reqs if tuple(r.prompt[:32]) == p]
        assert len(group) == 4 and len({tuple(r.prompt[32:]) for r in group}) == 4


def test_jsonl(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join([json.dumps({"prompt": "a b c", "output_len": 7}),
                               "", json.dumps({"prompt": [5, 6], "max_tokens": 3}),
                               json.dumps({"prompt": "x"})]))
    reqs = jsonl_dataset(path, default_output_len=11)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in reqs] == [("a b c", 3, 7), ([5, 6], 2, 3), ("x", 1, 11)]
    path.write_text('{"nope": 1}\n')
    with pytest.raises(ValueError, match=":1:"):
        jsonl_dataset(path)
