"""Tenants (key files, salts, auth), request hashing (token ids, built-in and HF tokenizers, text
fallback), the approximate index, and KvAware's session affinity."""

from __future__ import annotations

import json
import re

import pytest

from agentkv.errors import UserError
from agentkv.kv.hashing import make_hasher
from agentkv.placement.policy import KvAware, RouteRequest
from agentkv.route.approx import ApproxIndex
from agentkv.route.index import Match
from agentkv.route.prompt import RequestHasher, Tokenizer
from agentkv.route.tenants import ANONYMOUS, Tenants, parse_api_keys, read_secret_file, tenant_salt
from agentkv.trace.tokens import apply_chat_template, encode


def test_key_files_json_and_lines(tmp_path):
    j = tmp_path / "k.json"
    j.write_text(json.dumps({"k1": "acme", "k2": "acme", "k3": "beta"}))
    assert parse_api_keys(j) == {"k1": "acme", "k2": "acme", "k3": "beta"}
    j.write_text(json.dumps([{"key": "k1", "tenant": "acme"}]))
    assert parse_api_keys(j) == {"k1": "acme"}
    t = tmp_path / "k.txt"
    t.write_text("# comment\nk1 acme\n\nk2   beta  # trailing\n")
    assert parse_api_keys(t) == {"k1": "acme", "k2": "beta"}
    for text, where in (
        ("k1 acme extra\n", "line 1"),
        ("k1 a\nk1 b\n", "line 2: duplicate"),
        ('{"k": ""}', "key #1"),
        ('[{"key": "k"}]', "record 1"),
        ("{bad", "invalid JSON"),
        ("# nothing\n", "no keys"),
    ):
        t.write_text(text)
        with pytest.raises(UserError, match=where):
            parse_api_keys(t)
    with pytest.raises(UserError, match="cannot read"):
        parse_api_keys(tmp_path / "missing")


def test_admin_keys_open_metrics_only():
    """`@admin` keys are not tenants: they read /metrics and /debug/index and cannot generate."""
    tenants = Tenants({"k-a": "a", "k-admin": "@admin"}, b"s")
    assert tenants.authenticate({"Authorization": "Bearer k-admin"}) is None
    assert tenants.admin({"Authorization": "Bearer k-admin"}) is True
    assert tenants.admin({"Authorization": "Bearer k-a"}) is False  # a tenant: 403
    assert tenants.admin({}) is None and tenants.admin({"x-api-key": "nope"}) is None  # 401
    assert len(tenants) == 1 and tenants.admins == 1 and "@admin" not in tenants.salts().values()
    assert Tenants(None, b"").admin({}) is True  # no --api-keys: open, as before


def test_router_secret_file(tmp_path):
    f = tmp_path / "secret"
    f.write_text("  s3cret  \nsecond line\n")
    assert read_secret_file(f) == "s3cret"
    f.write_text("\n \n")
    with pytest.raises(UserError, match="empty"):
        read_secret_file(f)
    with pytest.raises(UserError, match="cannot read"):
        read_secret_file(tmp_path / "missing")


def test_authenticate_and_salts():
    tenants = Tenants({"secret-a": "a", "secret-b": "b", "other-a": "a"}, b"router-secret")
    ta = tenants.authenticate({"Authorization": "Bearer secret-a"})
    assert ta is not None and ta.id == "a"
    assert tenants.authenticate({"authorization": "bearer other-a"}) == ta
    assert tenants.authenticate({"x-api-key": "secret-b"}).id == "b"
    for h in (
        {},
        {"Authorization": "Bearer secret-c"},
        {"Authorization": "secret-a"},
        {"Authorization": "Bearer "},
        {"x-api-key": "SECRET-A"},
    ):
        assert tenants.authenticate(h) is None
    # vLLM accepts the salt: non-empty, <= 128 chars, none of @ / \ NUL; stable per secret
    assert re.fullmatch(r"[0-9a-f]{64}", ta.salt) and ta.salt == tenant_salt(b"router-secret", "a")
    assert (
        ta.salt != tenant_salt(b"other-secret", "a")
        and ta.salt != tenants.authenticate({"x-api-key": "secret-b"}).salt
    )
    assert tenants.salts() == {
        tenant_salt(b"router-secret", "a"): "a",
        tenant_salt(b"router-secret", "b"): "b",
    }
    assert Tenants(None, b"").authenticate({}) is ANONYMOUS


def test_request_hashing_matches_the_engine():
    xx = make_hasher("xxhash")
    rh = RequestHasher(xx, 16, Tokenizer("builtin"))
    ids = list(range(1000, 1040))
    h = rh.hash({"prompt": ids}, chat=False, salt="s")
    assert h.exact and h.prompt_tokens == 40 and h.hashes == xx.hashes(ids, 16, cache_salt="s")
    assert rh.hash({"prompt": [ids]}, chat=False, salt=None).hashes == xx.hashes(ids, 16)
    text = "the quick brown fox " * 20
    assert rh.hash({"prompt": text}, False, None).hashes == xx.hashes(encode(text), 16)
    msgs = [
        {"role": "system", "content": "be brief " * 30},
        {"role": "user", "content": [{"type": "text", "text": "hi " * 40}]},
    ]
    rendered = [
        {"role": "system", "content": "be brief " * 30, "name": None, "tool_calls": None},
        {"role": "user", "content": "hi " * 40, "name": None, "tool_calls": None},
    ]
    assert rh.hash({"messages": msgs}, True, None).hashes == xx.hashes(
        encode(apply_chat_template(rendered)), 16
    )
    # vLLM's sha256 family: the event hashes a vLLM engine would publish
    v = make_hasher("sha256", "")
    assert RequestHasher(v, 16, Tokenizer(None)).hash({"prompt": ids}, False, "s").hashes == v.hashes(
        ids, 16, cache_salt="s"
    )


def test_text_without_tokenizer_is_approximate_and_salted():
    rh = RequestHasher(make_hasher("xxhash"), 16, Tokenizer(None))
    base = "x" * 640
    a = rh.hash({"prompt": base + "tail one"}, False, None)
    b = rh.hash({"prompt": base + "another tail"}, False, None)
    assert not a.exact and len(a.hashes) == 10 and a.hashes == b.hashes  # shared 640-char prefix
    assert rh.hash({"prompt": base}, False, "t2").hashes != a.hashes
    chat = rh.hash({"messages": [{"role": "user", "content": base}]}, True, None)
    assert not chat.exact and chat.hashes


def test_hf_tokenizer_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "again": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    t = Tokenizer(str(tmp_path))
    assert t.kind == "hf" and t.encode("hello world again zzz") == [1, 2, 3, 0]
    xx = make_hasher("xxhash")
    h = RequestHasher(xx, 2, t).hash({"prompt": "hello world again hello"}, False, None)
    assert h.exact and h.hashes == xx.hashes([1, 2, 3, 1], 2)
    assert (
        not RequestHasher(xx, 2, t)
        .hash({"messages": [{"role": "user", "content": "hello"}]}, True, None)
        .exact
    )
    with pytest.raises(UserError, match="no tokenizer.json"):
        Tokenizer(str(tmp_path / "nope"))


def test_approximate_index_capacity_and_expiry():
    now = [0.0]
    ax = ApproxIndex(capacity=6, ttl=10.0, clock=lambda: now[0])
    ax.record(0, "t", [1, 2, 3, 4])
    ax.record(1, "t", [1, 2])
    assert ax.find_matches("t", [1, 2, 3, 4, 5]) == {0: Match(4), 1: Match(2)}
    assert ax.find_matches("u", [1, 2]) == {}  # another tenant sees nothing
    ax.record(0, "t", [7, 8, 9])  # over capacity by one: the tail of the oldest prompt (4) goes first
    assert ax.find_matches("t", [1, 2, 3, 4]) == {0: Match(3), 1: Match(2)}
    assert ax.blocks(0) == 6
    now[0] = 5.0
    ax.record(1, "t", [1, 2])  # touched again: lives until 15
    now[0] = 11.0
    assert ax.find_matches("t", [1, 2]) == {1: Match(2)}
    assert ax.clear_worker(1) == 2 and ax.find_matches("t", [1, 2]) == {}


class _W:
    def __init__(self, cached: int, active: int):
        self.cached, self.active = cached, active

    def active_requests(self):
        return self.active

    def active_blocks(self):
        return self.active * 4

    def active_prefill_blocks(self):
        return 0.0

    def cached_prefix(self, hashes):
        return self.cached, 0


def test_kv_aware_session_affinity_yields_to_load():
    p = KvAware(affinity=8.0)
    req = RouteRequest(list(range(20)), 320, session="s1")
    assert p.choose(req, [_W(0, 0), _W(20, 0), _W(0, 0)]) == 1
    # the index lost the prefix (e.g. approximate text): the session stays home, within 8 blocks
    assert p.choose(req, [_W(0, 0), _W(0, 1), _W(0, 0)]) == 1
    # home overloaded: it moves
    assert p.choose(req, [_W(0, 0), _W(0, 30), _W(0, 0)]) != 1
    plain = KvAware()
    assert plain.choose(RouteRequest(list(range(20)), 320, session="s1"), [_W(0, 0), _W(0, 1), _W(0, 0)]) != 1


def test_router_load_counts_streaming_requests_not_queued_ones():
    """A request counts as KV load from its first byte to its end; queued, it counts only as a request."""
    from agentkv.route.workers import Worker, WorkerSpec

    w = Worker(0, WorkerSpec("http://127.0.0.1:1"), block_size=16, approximate=True)
    streamed, failed = w.start(320), w.start(640)
    assert (w.active_requests(), w.active_blocks()) == (2, 0)
    streamed.first_byte()
    assert (w.active_requests(), w.active_blocks()) == (2, 20)
    streamed.finish()
    failed.finish()  # failed before its first byte
    assert (w.active_requests(), w.active_blocks(), w.requests) == (0, 0, 2)


def test_a_retry_keeps_the_configured_weight_and_temperature():
    """A retried request is routed among the remaining workers with the same kv_aware settings,
    minus session affinity; other policies fall back to least_loaded."""
    from agentkv.route.proxy import Router, RouterConfig
    from agentkv.route.workers import WorkerSpec

    specs = [WorkerSpec("http://127.0.0.1:9"), WorkerSpec("http://127.0.0.1:10")]
    r = Router(RouterConfig(workers=specs, kv_weight=3.0, temperature=0.5, affinity=8.0))
    first, retry = r._make_policy(), r._make_policy(retry=True)
    assert (first.weight, first.temperature, first.affinity) == (3.0, 0.5, 8.0)
    assert (retry.name, retry.weight, retry.temperature, retry.affinity) == ("kv_aware", 3.0, 0.5, 0.0)
    assert (
        Router(RouterConfig(workers=specs, policy="session"))._make_policy(retry=True).name == "least_loaded"
    )
