"""Prompts from trace blocks: exact token ids, shared prefixes, text rendering, salts and cache busting."""

from __future__ import annotations

import msgspec
import pytest

from agentkv.bench.prompts import PromptBuilder
from agentkv.errors import UserError
from agentkv.trace.model import Request, Session, Trace
from agentkv.trace.plan import ReplayPlan, simulate_schedule
from agentkv.trace.tokens import encode


def _items(scope: str = "local"):
    reqs = [
        Request(t=0, input_tokens=70, output_tokens=2, hash_ids=[5, 6]),  # 2 blocks of 32 + 6 tokens
        Request(t=1, input_tokens=150, output_tokens=2, hash_ids=[5, 6, 9, 11]),  # filler past block 11
        Request(t=2, input_tokens=40, output_tokens=2, hash_ids=[5, 6, 9]),
    ]  # shorter than its blocks
    t = Trace(id="tr", block_size=32, session=Session(id="tr", requests=reqs), hash_id_scope=scope)
    return [sp.item for sp in simulate_schedule(ReplayPlan([t], lanes=1), lambda it: 1.0)]


def _ids(pb: PromptBuilder, item) -> list[int]:
    p = pb.prompt(item)
    return msgspec.json.decode(bytes(p)) if isinstance(p, msgspec.Raw) else encode(p)


@pytest.mark.parametrize("mode", ["token-ids", "text"])
def test_prompt_is_the_exact_token_blocks(mode):
    pb = PromptBuilder(mode)
    items = _items()
    for it in items + items:  # the second pass comes from the block cache
        ids = _ids(pb, it)
        assert ids == pb.tokens(it).tolist()
        assert len(ids) == it.request.input_tokens
    a, b, c = (_ids(pb, it) for it in items)
    assert a[:64] == b[:64] and a[64:] != b[64:70]  # blocks 5, 6 shared; a's tail is filler, b's is block 9
    assert c == b[:40]


def test_cache_bust_keeps_lengths_and_changes_the_first_block():
    plain, bust = PromptBuilder(), PromptBuilder(cache_bust=True, bust_marker="a1b2c3d4e5f6")
    other = PromptBuilder(cache_bust=True, bust_marker="0000000000ff")
    for it in _items():
        p, b, o = _ids(plain, it), _ids(bust, it), _ids(other, it)
        assert len(p) == len(b) and p[2:] == b[2:] and p[:2] != b[:2] and b[:2] != o[:2]
    assert "a1b2c3d4e5f6" in bust.description


def test_tenant_salts_are_valid_cache_salts():
    it = _items()[0]
    assert PromptBuilder().extra(it) == {}
    salt = PromptBuilder(tenant_salts=True, cache_bust=True, bust_marker="ab").extra(it)["cache_salt"]
    assert salt == "ab-tr#0"
    assert all(ch not in salt for ch in "@/\\\0") and 0 < len(salt) <= 128


def test_ceiling_key_splits_tenants_only_for_global_ids():
    loc, glob = _items("local")[0], _items("global")[0]
    assert PromptBuilder(tenant_salts=True).ceiling_key(loc) == "tr#0"
    assert PromptBuilder().ceiling_key(glob) == "global:tr"  # the file's space (no source: the id)
    assert PromptBuilder(tenant_salts=True).ceiling_key(glob) == "global:tr|tr#0"


def test_bad_options():
    with pytest.raises(UserError, match="--prompt-mode"):
        PromptBuilder("words")
    with pytest.raises(UserError, match="only used with --prompt-mode text"):
        PromptBuilder("token-ids", tokenizer="x.json")
    with pytest.raises(UserError, match="no tokenizer.json"):
        PromptBuilder("text", tokenizer="/nonexistent/tok")


def _word(i: int) -> str:
    out = ""
    i += 1
    while i:
        i, r = divmod(i - 1, 26)
        out = chr(97 + r) + out
    return out


def test_hf_tokenizer_renders_text(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    # byte-level like Llama 3's: every token a space-led word, so text round-trips exactly
    vocab = {"\u0120" + _word(i): i for i in range(40000)}
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="\u0120a"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))
    pb = PromptBuilder("text", tokenizer=str(tmp_path))
    for it in _items():
        text = pb.prompt(it)
        assert tok.encode(text).ids == pb.tokens(it).tolist()
    assert "tokenizer.json" in pb.description


def test_redact_prompt_keeps_the_message_and_drops_what_it_quotes() -> None:
    import msgspec

    from agentkv.bench.prompts import redact_prompt

    prompt = "You are a coding agent. Fix the failing test in src/parser.py without touching the API."
    msg = f"This model's maximum context length is 8 tokens; prompt was: {prompt[5:70]}... (400)"
    out = redact_prompt(msg, prompt)
    assert out.startswith("This model's maximum context length is 8 tokens; prompt was: [prompt]")
    assert all(prompt[i : i + 16] not in out for i in range(len(prompt) - 16))
    assert redact_prompt("invalid token ids: [101, 2023, 2003, 1037, 3231]", msgspec.Raw(b"101,2023")) == (
        "invalid token ids: [[token ids]]"
    )
    assert redact_prompt("short", prompt) == "short"
    assert redact_prompt("no quote of the prompt here at all, none", prompt) == (
        "no quote of the prompt here at all, none"
    )
