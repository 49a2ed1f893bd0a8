"""Chat logprobs' `bytes` carry each token's real bytes, so a client can join the tokens of one multi-byte
character back into it (they used to carry U+FFFD's bytes, EF BF BD, for every such token)."""

from __future__ import annotations

from types import SimpleNamespace

from steploop.gateway.text.logprobs import TokenNamer, chat_logprobs


def engine_lp(token_id: int, top_ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(logprob=-0.5, top_token_ids=top_ids, top_logprobs=[-0.5] * len(top_ids))


def test_byte_level_tokens_of_one_emoji_join_back_into_it(tokenizer):
    ids = tokenizer.encode_sync("🌱😀 ok", add_special_tokens=False)
    namer = TokenNamer(tokenizer)
    assert any("\ufffd" in namer(t) for t in ids)   # the case this is about: pieces of a character
    content = chat_logprobs([namer.info(t, engine_lp(t, [t, ids[0]])) for t in ids])["content"]
    assert bytes(b for entry in content for b in entry["bytes"]).decode("utf-8") == "🌱😀 ok"
    for entry in content:
        assert entry["top_logprobs"][0]["bytes"] == entry["bytes"]   # the same token in its own top list


def test_whole_character_tokens_keep_their_texts_bytes(tokenizer):
    ids = tokenizer.encode_sync("Hello été", add_special_tokens=False)
    namer = TokenNamer(tokenizer)
    content = chat_logprobs([namer.info(t, engine_lp(t, [t])) for t in ids])["content"]
    assert [entry["bytes"] for entry in content] == [list(namer(t).encode("utf-8")) for t in ids]


class ByteFallbackTokenizer:
    """SentencePiece's byte fallback: id 7 is the piece <0xF0>, which decodes alone to U+FFFD."""

    def decode(self, token_ids, skip_special_tokens=True):
        return "".join("\ufffd" if t == 7 else "▁x" for t in token_ids)

    def convert_ids_to_tokens(self, token_id):
        return "<0xF0>" if token_id == 7 else "▁x"


def test_sentencepiece_byte_fallback_piece_gives_its_byte():
    namer = TokenNamer(ByteFallbackTokenizer())
    assert namer.raw_bytes(7) == b"\xf0"
    assert namer.raw_bytes(3) is None
    content = chat_logprobs([namer.info(7, engine_lp(7, [7, 3]))])["content"]
    assert content[0]["bytes"] == [0xF0]
    assert [top["bytes"] for top in content[0]["top_logprobs"]] == [[0xF0], list("▁x".encode())]
