"""JSON bodies checked before they are trusted: nesting at most MAX_DEPTH deep, and every decoder
failure (malformed, wrong types, nesting past the interpreter's recursion limit) one RequestError.

The depth check is cheap where it matters: a body with fewer opening brackets than the limit
passes at once (almost every request); otherwise strings are cut out and the brackets counted
in C (re, bytes.translate, numpy), about 10 ms per MiB of brackets.
"""

from __future__ import annotations

import re

import msgspec
import numpy as np

from agentkv.gate.errors import RequestError

MAX_DEPTH = 128  # OpenAI bodies nest ~6 deep, JSON Schemas in `tools` a few dozen at most
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_KEEP = bytes(range(256)).translate(None, b"[]{}")  # every byte but brackets: deleted by translate
_PATH = re.compile(r"at `\$\.([A-Za-z_][A-Za-z0-9_]*)")
_INT_RUN = re.compile(rb"\[[0-9\s,+-]*")  # an array's opening bracket and the integers that follow
_any = msgspec.json.Decoder()


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body` (brackets inside strings do not count)."""
    brackets = _STRING.sub(b"", body).translate(None, _KEEP)
    if not brackets:
        return 0
    a = np.frombuffer(brackets, np.uint8)
    steps = np.where((a == 0x5B) | (a == 0x7B), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max())


def check_depth(body: bytes, limit: int = MAX_DEPTH) -> None:
    """RequestError 400 when `body` nests deeper than `limit`."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return
    depth = json_depth(body)
    if depth > limit:
        raise RequestError(f"the JSON body nests {depth} levels deep; at most {limit} are accepted")


def long_int_list(body: bytes, floor: int) -> int:
    """The element count of a JSON array of integers in `body` with more than `floor` elements, else 0.
    Counted on the raw bytes (commas, in C: ~5 ms per MiB), so a token-id list too long for any
    worker is refused before it is decoded into Python ints (~36 bytes each). An array inside a
    string counts too: such text is at least as many tokens."""
    if body.count(b",") < floor:  # almost every body: fewer commas than the bound
        return 0
    for m in _INT_RUN.finditer(body):
        start, end = m.span()
        if end - start > floor and (n := body.count(b",", start, end) + 1) > floor:
            return n  # (each element takes two bytes at least: a digit and a comma)
    return 0


def decode(body: bytes, decoder: msgspec.json.Decoder = _any, limit: int = MAX_DEPTH):
    """`body` decoded (typed when the decoder is); RequestError 400 naming the key when it can."""
    check_depth(body, limit)
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = _PATH.search(msg)
        raise RequestError(f"invalid request: {msg}", m.group(1) if m else None) from None
    except msgspec.DecodeError as e:
        raise RequestError(f"malformed JSON body: {e}") from None
    except RecursionError:
        raise RequestError("the JSON body nests too deeply") from None
    except UnicodeDecodeError:
        raise RequestError("the JSON body is not valid UTF-8") from None


def decode_object(body: bytes, limit: int = MAX_DEPTH) -> dict:
    """`body` as a JSON object (untyped); RequestError 400 when it is anything else."""
    data = decode(body, _any, limit)
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    return data
