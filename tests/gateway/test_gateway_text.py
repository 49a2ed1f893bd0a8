"""Incremental detokenization and stop strings, on the real tokenizer (no engine, no HTTP)."""

from __future__ import annotations

import pytest

from steploop.gateway.text.detokenizer import IncrementalDetokenizer
from steploop.gateway.text.stop_strings import StopStringMatcher

MULTIBYTE = ["你好，世界", "emoji 🎉🚀👩‍👩‍👧 done", "naïve café ü", "混合 text 和 🙂 emoji"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_detokenizer_multibyte_never_emits_partial_chars(tokenizer, text):
    ids = tokenizer.encode_sync(text, add_special_tokens=False)
    # The point of the test: some characters really are split across several tokens.
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids) or len(ids) < len(text)
    prompt = tokenizer.encode_sync("Say something:", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add([i]) for i in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.output_text


def test_detokenizer_split_emoji_waits_for_last_byte(tokenizer):
    ids = tokenizer.encode_sync("🎉", add_special_tokens=False)
    assert len(ids) >= 2, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add([ids[-1]]) == "🎉"


def test_detokenizer_flush_emits_a_trailing_half_character_as_decode_does(tokenizer):
    """A generation that stops (max_tokens) inside a multi-token character: the streamed text still adds up to
    decode(output ids), U+FFFD included, instead of silently dropping the last tokens."""
    ids = tokenizer.encode_sync("ok 🎉", add_special_tokens=False)[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    streamed = "".join(detok.add([i]) for i in ids)
    assert "\ufffd" not in streamed
    tail = detok.flush()
    assert tail.endswith("\ufffd")
    assert streamed + tail == tokenizer.decode(ids) == detok.output_text
    assert detok.flush() == ""
    whole = IncrementalDetokenizer(tokenizer, [])
    assert whole.add(tokenizer.encode_sync("fine", add_special_tokens=False)) == "fine" and whole.flush() == ""


def test_detokenizer_skips_special_tokens_and_keeps_spaces(tokenizer):
    text = "Hello world, how are you?"
    ids = tokenizer.encode_sync(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode_sync("Hi", add_special_tokens=False))
    assert "".join(detok.add([i]) for i in ids) == text
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert keep.add(ids).endswith(tokenizer.hf.eos_token)


def test_detokenizer_many_tokens_at_once(tokenizer):
    text = "".join(MULTIBYTE)
    ids = tokenizer.encode_sync(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [])
    out = "".join(detok.add(ids[i:i + 3]) for i in range(0, len(ids), 3))
    assert out == text


def feed_all(matcher, pieces):
    out = [matcher.feed(p) for p in pieces]
    return out, matcher.flush()


def test_stop_string_across_pieces_is_held_back_then_cut():
    m = StopStringMatcher(["\nUser:"])
    out, rest = feed_all(m, ["Sure.", "\nUs", "er:", " more"])
    assert out == ["Sure.", "", "", ""] and rest == ""
    assert m.stopped and m.matched == "\nUser:"


def test_stop_string_false_alarm_is_released():
    m = StopStringMatcher(["\nUser:"])
    out, rest = feed_all(m, ["a\nU", "nicorn"])
    assert "".join(out) + rest == "a\nUnicorn"
    assert out[0] == "a" and not m.stopped


def test_stop_string_include_in_output_and_earliest_wins():
    m = StopStringMatcher(["world", "lo w"], include_stop_str_in_output=True)
    assert m.feed("hello world") == "hello w"
    assert m.matched == "lo w"


def test_stop_string_flush_releases_tail_at_end():
    m = StopStringMatcher(["STOP"])
    assert m.feed("the end ST") == "the end "
    assert m.flush() == "ST"


def test_no_stop_strings_passes_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == "abc" and m.flush() == ""


def test_tokenizer_decode_is_transformers_decode(tokenizer):
    """Tokenizer.decode goes straight to the Rust decoder; it must return what transformers' decode does."""
    assert tokenizer._rust is not None
    hf = tokenizer.hf
    texts = MULTIBYTE + ["  leading spaces", "tabs\tand\nnewlines", "it's don't", "a , b . c ?"]
    ids = [hf.encode(t) for t in texts]
    ids += [[hf.eos_token_id, *i, hf.eos_token_id] for i in ids[:3]]            # special tokens around text
    ids += [i[:k] for i in ids[:4] for k in range(1, len(i))]                   # every prefix: split characters
    for seq in ids:
        for skip in (True, False):
            assert tokenizer.decode(seq, skip_special_tokens=skip) == hf.decode(seq, skip_special_tokens=skip)
