"""The built-in tokenizer: exact round trips of ids through text, stable hashing of other text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.trace import tokens as T
from agentkv.trace.blocks import DEFAULT_VOCAB


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=T.VOCAB_SIZE - 1), max_size=200))
def test_ids_round_trip_through_text(ids):
    assert T.encode(T.decode(ids)) == ids


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=2**40), max_size=50))
def test_round_trip_beyond_the_vocabulary(ids):
    assert T.encode(T.decode(ids)) == ids


def test_every_id_has_its_own_word():
    words = [T.token_text(i) for i in range(T.VOCAB_SIZE)]
    assert len(set(words)) == T.VOCAB_SIZE
    assert T.encode(" ".join(words)) == list(range(T.VOCAB_SIZE))
    # the trace token range the benchmark sends as text is inside the round-trip range
    lo, hi = DEFAULT_VOCAB
    assert 0 <= lo < hi <= T.VOCAB_SIZE


def test_words_are_stable():
    # pinned: a change here changes every text prompt's token ids (and so every cache key)
    assert [T.token_text(i) for i in (0, 1, 63, 64, 65, 4159, 4160)] == [
        "ba",
        "bi",
        "zu",
        "baba",
        "babi",
        "zuzu",
        "bababa",
    ]
    assert T.decode([1, 64, 0]) == "bi baba ba"


def test_other_text_hashes_deterministically_into_the_vocabulary():
    text = "Hello, world! Tokenization of 1234567 <|user|> café\n\tend."
    ids = T.encode(text)
    assert ids == T.encode(text)
    assert all(0 <= i < T.VOCAB_SIZE for i in ids)
    # pieces: Hello , world ! Token izati on of 123 456 7 <|user|> caf é end .
    assert len(ids) == 16
    assert T.encode("Hello") == [ids[0]]
    assert T.encode("<|user|>") == [ids[11]]
    # whitespace only separates pieces
    assert T.encode("a  b\n c") == T.encode("a b c")
    assert T.encode("") == [] and T.encode(" \n\t") == []


def test_negative_ids_are_refused():
    import pytest

    with pytest.raises(ValueError):
        T.decode([1, -1])


def test_output_text_is_deterministic_filler_that_encodes_back():
    ids = T.output_ids(50)
    assert ids == T.output_ids(50)
    assert T.output_ids(10, start=40) == ids[40:]
    text = "".join(T.output_text(i) for i in range(50))
    assert T.encode(text) == ids
    assert not T.output_text(0).startswith(" ") and T.output_text(1).startswith(" ")


def test_chat_template_keeps_earlier_turns_as_a_token_prefix():
    turn1 = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "List files, please."},
    ]
    reply = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "ls", "arguments": '{"path": "."}'}}
        ],
    }
    turn2 = [*turn1, reply, {"role": "tool", "content": "a.py b.py", "tool_call_id": "c1"}]
    ids1 = T.encode(T.apply_chat_template(turn1, add_generation_prompt=False))
    ids2 = T.encode(T.apply_chat_template(turn2))
    assert ids2[: len(ids1)] == ids1 and len(ids2) > len(ids1)
    rendered = T.apply_chat_template(turn2)
    assert "<|tool_call|> ls" in rendered and rendered.endswith("<|assistant|>\n")


def test_exported_hf_tokenizer_matches(tmp_path):
    import pytest

    tokenizers = pytest.importorskip("tokenizers")
    out = T.write_hf_tokenizer(tmp_path / "tok")
    tk = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = [0, 1, 63, 64, 4160, 31337, T.VOCAB_SIZE - 1]
    assert tk.encode(T.decode(ids)).ids == ids
    assert tk.decode(ids) == T.decode(ids)
    assert tk.encode("Hello world").ids == [T.VOCAB_SIZE, T.VOCAB_SIZE]  # unknown words
    assert len(T.encode(T.UNK)) == 1  # AIPerf's prompts of unknown words keep their length here


_PIECES = ["ba", "hello", "x", "<|user|>", "123456", "!!", "é", "\u2003", "\x1c", " ", "\n", "a" * 70]
_PIECES += ["babababababababababa", "<|" + "a" * 40 + "|>", "." * 100, "zuzuzuzu"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=60), st.integers(0, 80))
def test_encode_bounded_is_encode_or_none(parts, limit):
    """`encode_bounded` gives `encode`'s ids, or None exactly when there are more than `limit`."""
    text = "".join(parts)
    ids = T.encode(text)
    got = T.encode_bounded(text, limit)
    assert got == (ids if len(ids) <= limit else None)


def test_encode_bounded_stops_early_on_huge_text():
    """Work is bounded by the limit, not the text: long words, whitespace, markers, pseudo-words."""
    import time

    for text in ("!" * 5_000_000, "word " * 1_000_000, "ba" * 2_500_000, "<|" + "a" * 5_000_000 + "|>"):
        t0 = time.process_time()
        assert T.encode_bounded(text, 4096) is None
        assert time.process_time() - t0 < 2.0  # tests assert no wall times; CPU for 5 MB is ~0.1 s
    assert T.encode_bounded(" " * 1_000_000 + "hi", 10) == T.encode("hi")


def test_long_pseudo_words_and_markers_are_bounded_pieces():
    """A pseudo-word past 8 syllables, or a marker past 32 characters, is not one token (a 1 MB
    pseudo-word once parsed as one id in quadratic time)."""
    assert len(T.encode("ba" * 9)) == 4  # 18 letters: 5-letter chunks, hashed
    assert T.encode("ba" * 8) == [T._parse("ba" * 8)]  # 8 syllables still read back exactly
    assert len(T.encode("<|" + "a" * 32 + "|>")) == 1
    assert len(T.encode("<|" + "a" * 33 + "|>")) > 1
    long = "ba" * 500_000
    assert len(T.encode(long)) == 200_000  # linear: 5 letters a token


def _table_only(text: str, limit: int | None = None) -> list[int] | None:
    """The word-table path alone (what every text took before the array passes)."""
    saved, T._ARRAY_CHARS = T._ARRAY_CHARS, 1 << 62
    try:
        return T.encode(text) if limit is None else T.encode_bounded(text, limit)
    finally:
        T._ARRAY_CHARS = saved


_WORDS = [T.token_text(i) for i in (0, 63, 64, 4159, 4160, 128255, 266303, 266304, 2**40, 64**8 - 2)]
_WORDS += ["bab", "abab", "baba" * 5, "BaBa"]  # odd, vowel-first, too long, upper case: not pseudo-words


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(_PIECES + _WORDS), min_size=1, max_size=40), st.integers(0, 3000))
def test_long_text_takes_the_array_path_with_the_same_ids(parts, limit):
    """A text past _ARRAY_CHARS is encoded by whole-array passes: the same ids as the word table
    gives, and `encode_bounded` None exactly when they pass the limit."""
    text = "".join(parts) * (T._ARRAY_CHARS // len("".join(parts)) + 1)
    assert len(text) >= T._ARRAY_CHARS
    ids = _table_only(text)
    assert T.encode(text) == ids
    assert T.encode_bounded(text, limit) == _table_only(text, limit) == (ids if len(ids) <= limit else None)


def test_a_long_prompt_of_any_ids_round_trips_through_the_array_path():
    """Ids in and past the table (up to 8 syllables), any ASCII whitespace between, non-ASCII text
    falling back to the table."""
    import random

    rng = random.Random(7)
    ids = [
        rng.choice((rng.randrange(64), rng.randrange(T.VOCAB_SIZE), rng.randrange(64**8 - 1)))
        for _ in range(5000)
    ]
    words = [T.token_text(i) for i in ids]
    assert T.encode(" ".join(words)) == ids
    assert T.encode("\n\t\x1c ".join(words) + "\r\n") == ids
    assert T.encode(" é ".join(words)) == _table_only(" é ".join(words))
    assert T.encode_bounded(" ".join(words), 4999) is None and T.encode_bounded(" ".join(words), 5000) == ids
