"""Request parsing and vLLM's validation rules, without HTTP: each bad input is one RequestError."""

from __future__ import annotations

import json

import pytest

from agentkv.serve.protocol import Limits, RequestError, parse_chat, parse_completion
from agentkv.trace.tokens import apply_chat_template, decode, encode

LIMITS = Limits(("m", "llama3-8b"), max_model_len=256, vocab_size=128256, default_chat_tokens=32)


def comp(**body):
    return parse_completion(json.dumps(body).encode(), LIMITS)


def chat(**body):
    return parse_chat(json.dumps(body).encode(), LIMITS)


def refused(fn, body, param=None, status=400) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(**body) if isinstance(body, dict) else fn(body)
    assert e.value.status == status
    if param is not None:
        assert e.value.param == param
    return e.value


def test_prompt_forms_give_the_same_ids():
    ids = [5, 6, 7, 1000, 30999]
    by_ids = comp(prompt=ids, max_tokens=3)
    assert by_ids.prompt_ids == ids
    assert comp(prompt=decode(ids), max_tokens=3).prompt_ids == ids
    assert comp(prompt=[decode(ids)], max_tokens=3).prompt_ids == ids
    assert comp(prompt=[ids], max_tokens=3).prompt_ids == ids
    assert by_ids.kind == "completion" and by_ids.model == "m" and not by_ids.stream


def test_defaults_and_options():
    g = comp(prompt="hello there", model="llama3-8b")
    assert g.max_tokens == 16  # vLLM's default for completions
    g = chat(messages=[{"role": "user", "content": "hi"}])
    assert g.max_tokens == 32  # the server's --default-max-tokens
    g = comp(
        prompt="x",
        max_tokens=4,
        stream=True,
        stream_options={},
        cache_salt="tenant-1",
        ignore_eos=True,
        n=1,
        session_id=7,
    )
    assert g.stream and g.include_usage and not g.continuous_usage
    assert g.cache_salt == "tenant-1" and g.session_id == "7"
    g = comp(prompt="x", stream=True, stream_options={"include_usage": False, "continuous_usage_stats": True})
    assert not g.include_usage and g.continuous_usage


def test_unknown_keys_are_ignored():
    g = comp(
        prompt="x", max_tokens=2, rid="abc", bootstrap_host=None, lora_path=[1, {"a": 2}], return_text=True
    )
    assert g.max_tokens == 2


def test_chat_renders_messages_with_the_template():
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "result", "tool_call_id": "1"},
    ]
    g = chat(messages=msgs, max_completion_tokens=5, max_tokens=9)
    assert g.max_tokens == 5  # max_completion_tokens wins, as in vLLM
    flat = [{**msgs[0]}, {"role": "user", "content": "part one\ntwo"}, msgs[2], msgs[3]]
    assert g.prompt_ids == encode(apply_chat_template(flat))


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 5.5}, "max_tokens"),
        ({"prompt": "x", "stream": "yes"}, "stream"),
        ({"prompt": "x", "temperature": "hot"}, "temperature"),
        ({"prompt": "x", "stop": 3}, "stop"),
        ({"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"max_tokens": 3}, None),  # no prompt
        ({"prompt": "x", "stream_options": {"include_usage": "y"}, "stream": True}, "stream_options"),
    ],
)
def test_known_keys_with_wrong_types(body, param):
    e = refused(comp, body, param)
    assert "invalid request" in e.message


@pytest.mark.parametrize("raw", [b"{", b"not json", b"", b'{"prompt": "x",}', b"\xff\xfe"])
def test_malformed_json(raw):
    e = refused(lambda b: parse_completion(b, LIMITS), raw)
    assert "JSON" in e.message


def test_body_must_be_an_object():
    refused(lambda b: parse_completion(b, LIMITS), b'["prompt"]')


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   \n"}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),  # batched
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [-1, 2]}, "prompt"),
        ({"prompt": [128256]}, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "max_tokens": -5}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 10**12}, "max_tokens"),
        ({"prompt": "x", "max_tokens": 256}, "max_tokens"),  # 1 + 256 > 256
        ({"prompt": list(range(256)), "max_tokens": 1}, "prompt"),  # prompt alone fills the context
        ({"prompt": list(range(200)), "max_tokens": 57}, "max_tokens"),
        ({"prompt": "x", "n": 2}, "n"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "cache_salt": ""}, "cache_salt"),
        ({"prompt": "x", "cache_salt": "a" * 129}, "cache_salt"),
        ({"prompt": "x", "cache_salt": "a@b"}, "cache_salt"),
        ({"prompt": "x", "cache_salt": "a/b"}, "cache_salt"),
        ({"prompt": "x", "cache_salt": "a\\b"}, "cache_salt"),
        ({"prompt": "x", "cache_salt": "a\x00b"}, "cache_salt"),
        ({"prompt": "x", "cache_salt": 5}, "cache_salt"),
    ],
)
def test_bad_values(body, param):
    refused(comp, body, param)


def test_limits_at_the_edge_are_accepted():
    assert comp(prompt=list(range(200)), max_tokens=56).max_tokens == 56
    assert comp(prompt="x", cache_salt="a" * 128).cache_salt == "a" * 128
    assert comp(prompt=list(range(250))).max_tokens == 6  # default capped by the context


def test_unknown_model_is_404():
    e = refused(comp, {"prompt": "x", "model": "gpt-4"}, "model", status=404)
    assert e.err_type == "NotFoundError"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
            "messages",
        ),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 3}, "logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            "continue_final_message",
        ),
    ],
)
def test_bad_chat_requests(body, param):
    refused(chat, body, param)


def test_error_messages_never_quote_the_prompt():
    secret = "SECRET-PROMPT-TEXT"
    for body in (
        {"prompt": secret, "max_tokens": 10**9},
        {"prompt": [secret, secret]},
        {"prompt": secret, "cache_salt": ""},
        {"prompt": secret, "n": 3},
    ):
        assert secret not in refused(comp, body).message
    e = refused(chat, {"messages": [{"role": "wizard", "content": secret}]})
    assert secret not in e.message
