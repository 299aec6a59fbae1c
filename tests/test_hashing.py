"""Block hashing: vLLM's vectors, the prefix property, salts, LoRA, incremental hashing, trace tokens."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import pickle
import subprocess
import sys

import cbor2
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.errors import UserError
from agentkv.kv.hashing import (
    ALGOS,
    VllmHasher,
    XxHasher,
    as_token_array,
    block_hashes,
    event_hash,
    make_hasher,
)
from agentkv.trace.blocks import chain_keys, key_chain, request_tokens, space_key, trace_block_tokens

# ../shared/vllm/README.md: observed on a live vLLM 0.32.0, PYTHONHASHSEED unset, block size 32.
PROMPT = list(range(1, 65))
VEC_PLAIN = [11290800355336220572, 11189021207153552290]
VEC_SALTED = [9814989143922616389, 6078964196695249834]
NONE_HASH_HEX = "066b1e8987e027138e98701c46128929378935f9b6cd1549105ae6b4f0d71198"

RNG = np.random.default_rng(7)


def _common(a, b) -> int:
    """Length of the common prefix of two key sequences."""
    a, b = np.asarray(a), np.asarray(b)
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


_CHILD = """
import hashlib, json
from agentkv.kv.hashing import VllmHasher
from agentkv.trace.blocks import request_tokens
prompt = list(range(1, 65))
print(json.dumps({
    "sha256": VllmHasher("sha256").event_hashes(prompt, 32),
    "sha256_cbor": VllmHasher("sha256_cbor").event_hashes(prompt, 32),
    "trace": hashlib.sha256(request_tokens("trace_0042", [3, 1, 4, 1, 5, 9], 500, 64).tobytes()).hexdigest(),
}))
"""


@functools.cache
def _child(seed: str | None) -> dict:
    """What a fresh interpreter computes, with PYTHONHASHSEED set to `seed` or unset."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


# vLLM-exact ------------------------------------------------------------------------------------


def test_vllm_sha256_vectors(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    h = VllmHasher("sha256")
    assert h.none_hash.hex() == NONE_HASH_HEX
    assert h.event_hashes(PROMPT, 32) == VEC_PLAIN
    assert h.event_hashes(PROMPT, 32, cache_salt="s1") == VEC_SALTED
    assert make_hasher("sha256").hashes(np.array(PROMPT, dtype=np.int64), 32) == VEC_PLAIN
    digests = h.block_hashes(PROMPT, 32)
    assert [len(d) for d in digests] == [32, 32]
    assert [int.from_bytes(d, "big") & (2**64 - 1) for d in digests] == VEC_PLAIN


def test_vllm_salt_only_in_first_block_extra_keys():
    h = VllmHasher("sha256", None)
    assert h.extra_keys(True, "s1", None) == (("cache_salt", "s1"),)
    assert h.extra_keys(False, "s1", None) is None
    assert h.extra_keys(True, None, "ad") == (("lora", "ad"),)
    assert h.extra_keys(True, "s1", "ad") == (("lora", "ad"), ("cache_salt", "s1"))
    legacy = VllmHasher("sha256", None, tagged=False)
    assert legacy.extra_keys(True, "s1", "ad") == ("ad", "s1")
    # the salted second block differs only through its parent
    d = h.block_hashes(PROMPT, 32, cache_salt="s1")
    assert h.block_hashes(PROMPT[32:], 32, parent=d[0]) == d[1:]


def test_vllm_cbor_none_hash_and_block_from_spec():
    h = VllmHasher("sha256_cbor", None)
    # canonical CBOR of a 14-byte text string: major type 3 (0x60) | length 14, then UTF-8
    assert cbor2.dumps("vllm-none-hash", canonical=True) == b"\x6e" + b"vllm-none-hash"
    assert h.none_hash == hashlib.sha256(b"\x6evllm-none-hash").digest()
    first = hashlib.sha256(cbor2.dumps((h.none_hash, tuple(PROMPT[:32]), None), canonical=True)).digest()
    assert h.block_hashes(PROMPT, 32)[0] == first


def test_vllm_cbor_is_deterministic_and_differs_from_pickle():
    a, b = VllmHasher("sha256_cbor", None), VllmHasher("sha256_cbor", None)
    toks = RNG.integers(0, 50_000, 1000).tolist()
    assert a.event_hashes(toks, 16) == b.event_hashes(toks, 16)
    assert _child(None)["sha256_cbor"] == a.event_hashes(PROMPT, 32)
    pick = VllmHasher("sha256", None).event_hashes(toks, 16)
    assert all(x != y for x, y in zip(a.event_hashes(toks, 16), pick, strict=True))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_vllm_pythonhashseed(monkeypatch, algo):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    seeded = VllmHasher(algo)
    assert seeded.seed == "42"
    ser = pickle.dumps("42", protocol=pickle.HIGHEST_PROTOCOL) if algo == "sha256" else cbor2.dumps("42")
    assert seeded.none_hash == hashlib.sha256(ser).digest()
    assert seeded.none_hash != VllmHasher(algo, None).none_hash
    assert all(
        x != y
        for x, y in zip(
            seeded.event_hashes(PROMPT, 32), VllmHasher(algo, None).event_hashes(PROMPT, 32), strict=True
        )
    )
    # a fresh process reads the variable the same way; unset gives the default seed again
    assert _child("42")[algo] == seeded.event_hashes(PROMPT, 32)
    assert _child(None)[algo] == VllmHasher(algo, None).event_hashes(PROMPT, 32)


def test_vllm_parent_must_be_digest():
    h = make_hasher("sha256")
    with pytest.raises(TypeError, match="32-byte digest"):
        h.hashes(PROMPT, 32, parent=VEC_PLAIN[0])
    with pytest.raises(TypeError, match="64-bit"):
        make_hasher("xxhash").hashes(PROMPT, 32, parent=b"x" * 32)


# both families ---------------------------------------------------------------------------------


@pytest.fixture(params=ALGOS)
def hasher(request):
    return make_hasher(request.param, seed=None if request.param == "xxhash" else "0")


def test_prefix_property(hasher):
    base = RNG.integers(0, 32_000, 16 * 12).astype(np.int32)
    other = base.copy()
    other[16 * 5 + 3] += 1  # diverge inside block 5
    a, b = hasher.hashes(base, 16), hasher.hashes(other, 16)
    assert len(a) == len(b) == 12
    assert a[:5] == b[:5]
    assert all(x != y for x, y in zip(a[5:], b[5:], strict=True))
    assert len(set(a)) == len(a)  # same-position or not, no two blocks collide


def test_salt_isolates_tenants_and_lora_changes_every_block(hasher):
    toks = RNG.integers(0, 32_000, 16 * 6).tolist()
    plain = hasher.hashes(toks, 16)
    t1 = hasher.hashes(toks, 16, cache_salt="tenant-1")
    t2 = hasher.hashes(toks, 16, cache_salt="tenant-2")
    assert t1 == hasher.hashes(toks, 16, cache_salt="tenant-1")
    for x, y in ((plain, t1), (t1, t2), (plain, t2)):
        assert all(p != q for p, q in zip(x, y, strict=True))
    lora = hasher.hashes(toks, 16, lora_name="adapter-a")
    assert all(p != q for p, q in zip(plain, lora, strict=True))
    assert all(p != q for p, q in zip(lora, hasher.hashes(toks, 16, lora_name="adapter-b"), strict=True))
    # a LoRA named like a salt is not the salt
    assert hasher.hashes(toks, 16, lora_name="x")[0] != hasher.hashes(toks, 16, cache_salt="x")[0]
    # a continuation (parent given) is past the first block: the salt no longer applies
    first = hasher.chain(toks[:16], 16, cache_salt="tenant-1")
    assert hasher.hashes(toks[16:], 16, parent=first.tail, cache_salt="tenant-1") == t1[1:]
    assert hasher.hashes(toks[16:], 16, parent=first.tail) == t1[1:]


def test_partial_block_not_hashed(hasher):
    toks = list(range(100))
    keys = hasher.hashes(toks, 32)
    assert len(keys) == 3
    assert hasher.hashes(toks[:96] + [7] * 4, 32) == keys
    assert hasher.hashes(toks[:31], 32) == []
    ch = hasher.chain(toks[:31], 32)
    assert ch.keys == [] and ch.tail is None


def test_incremental_equals_one_shot(hasher):
    toks = RNG.integers(0, 32_000, 1000).astype(np.int32)
    whole = hasher.hashes(toks, 16, cache_salt="s", lora_name="l")
    seq = hasher.sequence(16, cache_salt="s", lora_name="l")
    got, i = [], 0
    for n in [0, 5, 11, 16, 1, 1, 300, 17, 0, 649]:
        got += seq.extend(toks[i : i + n])
        i += n
    assert i == len(toks) and seq.num_tokens == 1000
    assert got == seq.keys == whole
    # decode: one token at a time completes a block exactly at each boundary
    seq2 = hasher.sequence(16)
    done = [len(seq2.extend([t])) for t in toks[:64]]
    assert [k for k, d in enumerate(done) if d] == [15, 31, 47, 63]
    # chain continuation from a tail equals the one-shot suffix
    head = hasher.chain(toks[:480], 16)
    assert head.keys + hasher.hashes(toks[480:], 16, parent=head.tail) == hasher.hashes(toks, 16)


def test_xxhash_default_matches_function_and_inputs():
    toks = RNG.integers(0, 2**31 - 1, 4096)
    assert block_hashes(toks, 64) == block_hashes(toks.tolist(), 64) == XxHasher(0).hashes(toks, 64)
    assert block_hashes(toks, 64) != XxHasher(1).hashes(toks, 64)
    assert make_hasher("xxhash", "abc").hashes(toks, 64) == make_hasher("xxhash", "abc").hashes(toks, 64)
    assert all(0 <= k < 2**64 for k in block_hashes(toks, 64))


def test_bad_inputs():
    with pytest.raises(UserError, match="unknown hash algorithm 'md5'"):
        make_hasher("md5")
    for bs in (0, -16, 1.5, True):
        with pytest.raises(ValueError, match="block_size"):
            block_hashes(PROMPT, bs)
    with pytest.raises(ValueError, match="int32"):
        as_token_array([2**31])
    with pytest.raises(ValueError, match="int32"):
        as_token_array(np.array([2**40]))
    with pytest.raises(TypeError):
        as_token_array(np.array([1.0]))
    assert event_hash(bytes(24) + (5).to_bytes(8, "big")) == 5


# trace tokens and chain keys -------------------------------------------------------------------


def test_trace_tokens_are_deterministic_across_processes():
    toks = request_tokens("trace_0042", [3, 1, 4, 1, 5, 9], 500, 64)
    digest = hashlib.sha256(toks.tobytes()).hexdigest()
    assert _child("42")["trace"] == _child(None)["trace"] == digest
    assert toks.dtype == np.int32 and len(toks) == 500
    assert toks.min() >= 1000 and toks.max() < 31000
    assert space_key("trace_0042") == space_key("trace_0042") != space_key("trace_0043")


def test_request_tokens_are_blocks_then_filler():
    ids = [10, 11, 12]
    toks = request_tokens("t", ids, 64 * 3 + 40, 64, vocab=(5, 9))
    for i, h in enumerate(ids):
        assert np.array_equal(toks[64 * i : 64 * (i + 1)], trace_block_tokens("t", h, 64, vocab=(5, 9)))
    assert set(np.unique(toks)) <= {5, 6, 7, 8}
    assert np.array_equal(request_tokens("t", ids, 100, 64), request_tokens("t", ids, 300, 64)[:100])
    # filler follows from the last block: same blocks give the same filler, a different last block not
    assert np.array_equal(request_tokens("t", [1, 2], 300, 64), request_tokens("t", [1, 2], 300, 64))
    assert not np.array_equal(
        request_tokens("t", [1, 2], 300, 64)[128:], request_tokens("t", [1, 3], 300, 64)[128:]
    )
    assert len(request_tokens("t", [], 70, 64)) == 70 and len(request_tokens("t", ids, 0, 64)) == 0
    # the same hash id in another trace is another block (local hash-id scope)
    assert not np.array_equal(trace_block_tokens("a", 1, 64), trace_block_tokens("b", 1, 64))
    with pytest.raises(ValueError, match="vocab"):
        request_tokens("t", ids, 10, 64, vocab=(9, 9))


def _check_consistent(reqs, key, tbs, ebs):
    """Pairwise: common prefix of chain keys == common prefix of real token hashes."""
    real = [block_hashes(request_tokens(key, ids, n, tbs), ebs) for ids, n in reqs]
    keys = [chain_keys(space_key(key), ids, tbs, ebs, n) for ids, n in reqs]
    for r, k, (_, n) in zip(real, keys, reqs, strict=True):
        assert len(r) == len(k) == n // ebs
    partial = 0
    for i in range(len(reqs)):
        for j in range(i + 1, len(reqs)):
            c = _common(real[i], real[j])
            assert _common(keys[i], keys[j]) == c, (i, j)
            partial += 0 < c < min(len(real[i]), len(real[j]))
    return partial


@pytest.mark.parametrize("ebs", [4, 8, 16, 32, 64, 12, 24, 48])  # 12-48: neither divides 16 (gcd split)
def test_chain_keys_synthetic(ebs):
    tbs = 16
    reqs = [
        ([1, 2, 3, 4], 64),
        ([1, 2, 3, 4], 64 + 40),
        ([1, 2, 3, 5], 100),
        ([1, 2, 7], 100),
        ([1, 2], 100),
        ([1, 2], 90),
        ([9], 64),
        ([], 70),
        ([1, 2, 3, 4, 6, 8], 96),
        ([2, 1], 64),
        ([1, 2, 3, 4, 5, 6, 7, 8], 128),
        ([1, 2, 3, 4, 9, 9, 9, 9], 128),
    ]
    assert _check_consistent(reqs, "synthetic", tbs, ebs) > 0
    assert len(chain_keys(1, [1], 64, 16, 15)) == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), max_size=8), min_size=2, max_size=5),
    st.sampled_from([(8, 2), (8, 4), (8, 8), (4, 8), (4, 16), (8, 12), (6, 4), (4, 6)]),
    st.integers(0, 40),
)
def test_chain_keys_property(id_lists, sizes, extra):
    tbs, ebs = sizes
    reqs = [(ids, len(ids) * tbs + (extra * (i + 1)) % 20) for i, ids in enumerate(id_lists)]
    _check_consistent(reqs, 99, tbs, ebs)


# chain_keys of four requests before its compiled loop (the numpy form, main c3aa551): the keys a
# simulation's hits rest on stay the same from one version to the next
GOLDEN_KEYS = [
    (
        ("trace_0001", [5, 9, 2**40, 7], 64, 16, 300),
        18,
        [18314258125648110496, 15765074194891551040, 413077400704584244],
    ),
    (("x", [3, 1], 16, 48, 100), 2, [17268720444441287080, 15258356492302703767]),
    (("y", [], 64, 544, 1200), 2, [11566296188809617623, 11304280588612907417]),
    ((7, [1, 2, 3], 64, 256, 1000), 3, [10202674223177148425, 12414847138741322047, 15984337602178819684]),
]


@pytest.mark.parametrize(("args", "n", "tail"), GOLDEN_KEYS)
def test_chain_keys_are_stable(args, n, tail):
    keys = chain_keys(*args)
    assert keys.dtype == np.uint64 and len(keys) == n and keys.tolist()[-len(tail) :] == tail


def _reference_keys(space, ids, t, b, input_tokens) -> list[int]:
    """chain_keys by its definition, in Python ints mod 2**64, over the slot bases request_tokens uses."""
    from agentkv.trace import chain_loops as cl
    from agentkv.trace.blocks import _slot_bases

    m64 = (1 << 64) - 1

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * int(cl.M1)) & m64
        x = ((x ^ (x >> 27)) * int(cl.M2)) & m64
        return x ^ (x >> 31)

    n = input_tokens // b
    g = math.gcd(b, t)
    r, per = t // g, b // g
    bases = _slot_bases(space_key(space), ids, -(-n * per // r)).tolist()
    subs = [
        bases[q // r] if r == 1 else mix(bases[q // r] ^ (((q % r + 1) * int(cl.SUB)) & m64))
        for q in range(n * per)
    ]
    keys, p = [], 0
    for j in range(n):
        ident = subs[j * per]
        for s in range(1, per):
            ident = mix((ident * int(cl.GROUP) + subs[j * per + s]) & m64)
        p = (p * int(cl.R) + ident) & m64
        keys.append(mix(p ^ (((j + 1) * int(cl.DEPTH)) & m64)))
    return keys


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=12),
    st.sampled_from([(64, 16), (16, 64), (64, 64), (64, 544), (16, 48), (48, 16), (6, 4), (4, 6), (1, 1)]),
    st.integers(0, 1500),
    st.one_of(st.text(max_size=8), st.integers(0, 2**64 - 1)),
)
def test_chain_keys_equal_their_definition(ids, sizes, tokens, space):
    """The compiled loop against the construction written out in Python ints: real ids, filler past
    them, sub-blocks (engine block divides the trace's), folds (a multiple) and gcd splits (neither)."""
    t, b = sizes
    assert chain_keys(space, ids, t, b, tokens).tolist() == _reference_keys(space, ids, t, b, tokens)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 5), max_size=12),
    st.lists(st.integers(0, 5), max_size=12),
    st.integers(0, 12),
    st.sampled_from([(64, 16), (16, 64), (64, 64), (16, 48), (48, 16), (6, 4), (4, 6), (1, 1)]),
    st.tuples(st.integers(0, 900), st.integers(0, 900)),
    st.sampled_from([("s", "s"), ("s", "t"), (3, 3)]),
    st.booleans(),
)
def test_a_resumed_chain_equals_a_fresh_one(first, rest, keep, sizes, tokens, spaces, other_sizes):
    """`key_chain` from an earlier request's chain (a session's previous turn: a shared prefix of ids,
    then anything, in the same or another space, with other block sizes) gives the keys, prefix
    hashes and ids of a chain computed afresh."""
    t, b = sizes
    prev_sizes = (b, t) if other_sizes and t != b else (t, b)
    prev = key_chain(spaces[0], first, *prev_sizes, tokens[0])
    ids = first[:keep] + rest
    got = key_chain(spaces[1], ids, t, b, tokens[1], prev)
    fresh = key_chain(spaces[1], ids, t, b, tokens[1])
    assert got.keys.tolist() == fresh.keys.tolist() == chain_keys(spaces[1], ids, t, b, tokens[1]).tolist()
    assert got.state.tolist() == fresh.state.tolist() and got.ids.tolist() == fresh.ids.tolist()


@pytest.mark.shared
@pytest.mark.parametrize("ebs", [16, 64, 128, 544])  # 544: Qwen3-Next's block in vLLM
def test_chain_keys_match_token_hashing_on_real_trace(shared_dir, ebs):
    from agentkv.trace.formats import load

    trace = load(shared_dir / "traces" / "claude-code" / "trace_0001.json.gz")[0]
    assert trace.block_size == 64
    timeline = trace.timeline()
    picks = timeline[:4] + timeline[len(timeline) // 2 : len(timeline) // 2 + 2] + timeline[-2:]
    reqs = [(t.request.hash_ids, t.request.input_tokens) for t in picks]
    assert _check_consistent(reqs, trace.id, 64, ebs) > 0
