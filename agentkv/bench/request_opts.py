"""What bench adds to every request: `--header K:V`, `--extra-body JSON`, the API key
(`--api-key`, `--api-key-file`, else $OPENAI_API_KEY), and their redacted form for summary.json.

Each parser gives a one-line UserError naming its flag; the key is never printed or saved.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

from agentkv.errors import UserError

# framing and content negotiation the client sets itself; a second copy would break the request
RESERVED_HEADERS = (
    "host",
    "content-length",
    "transfer-encoding",
    "connection",
    "content-type",
    "accept",
    "user-agent",
)
# body fields the prompt fills: an --extra-body one would replace the trace's request
RESERVED_BODY = ("prompt", "messages")
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP header name (RFC 9110 token)
_SECRET = re.compile(r"auth|key|token|secret|cookie|password", re.I)
REDACTED = "<redacted>"
MAX_KEY_FILE_BYTES = 64 * 1024


class RequestOptions(msgspec.Struct, kw_only=True):
    """--header, --extra-body and the API key, parsed: what `BenchClient` sends with every request."""

    headers: dict[str, str] = {}  # --header, without the key
    extra_body: dict = {}
    key: str | None = None  # never written anywhere

    @classmethod
    def from_flags(cls, headers, extra_body, key, key_file) -> RequestOptions:
        """Parsed flags (one-line errors); the key falls back to the environment."""
        return cls(
            headers=parse_headers(headers),
            extra_body=parse_extra_body(extra_body),
            key=api_key(key, key_file),
        )

    def client_args(self) -> dict:
        """`BenchClient` keyword arguments."""
        return {"headers": auth_headers(self.key, self.headers), "extra_body": self.extra_body}

    def settings(self) -> dict:
        """What summary.json records: header values of credential-like names and the key redacted."""
        return {
            "headers": redacted(self.headers),
            "extra_body": self.extra_body,
            "api_key": REDACTED if self.key else None,
        }


def parse_headers(items: list[str] | None) -> dict[str, str]:
    """`--header K:V` values (repeatable) as a dict; names are HTTP tokens, values one latin-1 line."""
    out: dict[str, str] = {}
    for raw in items or ():
        name, sep, value = raw.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not name:
            raise UserError(f"--header: expected NAME:VALUE, e.g. 'X-Tenant: a', got {raw!r}")
        if not _TOKEN.match(name):
            raise UserError(f"--header: {name!r} is not a valid HTTP header name")
        if name.lower() in RESERVED_HEADERS:
            raise UserError(f"--header: {name} is set by agentkv bench itself; it cannot be replaced")
        if any(c in value for c in "\r\n\0") or not value.isascii() and not _latin1(value):
            raise UserError(f"--header {name}: the value must be one line of latin-1 text")
        out[name] = value
    return out


def _latin1(s: str) -> bool:
    try:
        s.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return True


def parse_extra_body(text: str | None) -> dict:
    """`--extra-body JSON`: an object merged into every request body (a file with @path)."""
    if text is None:
        return {}
    src = text
    if text.startswith("@"):
        src = read_text(text[1:], "--extra-body")
    try:
        v = msgspec.json.decode(src.encode())
    except msgspec.DecodeError as e:
        raise UserError(f"--extra-body: not valid JSON ({e})") from None
    if not isinstance(v, dict):
        raise UserError(
            f"--extra-body: expected a JSON object such as '{{\"top_k\": 1}}', got {type(v).__name__}"
        )
    bad = [k for k in v if k in RESERVED_BODY]
    if bad:
        raise UserError(f"--extra-body: {', '.join(bad)} is built from the trace; it cannot be replaced")
    return v


def read_text(path: str, flag: str) -> str:
    """A small text file's content, or a one-line error naming `flag` and the file."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_FILE_BYTES + 1)
    except OSError as e:
        raise UserError(f"{flag}: cannot read {path}: {e.strerror or e}") from None
    if len(data) > MAX_KEY_FILE_BYTES:
        raise UserError(f"{flag}: {path} is larger than {MAX_KEY_FILE_BYTES // 1024} KiB")
    try:
        return data.decode()
    except UnicodeDecodeError:
        raise UserError(f"{flag}: {path} is not UTF-8 text") from None


def api_key(key: str | None, key_file: str | None) -> str | None:
    """--api-key, else the first line of --api-key-file, else $AGENTKV_API_KEY / $OPENAI_API_KEY."""
    if key is not None and key_file is not None:
        raise UserError("--api-key and --api-key-file: give one")
    if key_file is not None:
        lines = read_text(key_file, "--api-key-file").strip().splitlines()
        key = lines[0].strip() if lines else ""
        if not key:
            raise UserError(f"--api-key-file: {Path(key_file)} is empty")
    if key is None:
        return os.environ.get("AGENTKV_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    if not key or any(c in key for c in "\r\n\0 ") or not _latin1(key):
        raise UserError("--api-key: the key must be one word of latin-1 text")
    return key


def auth_headers(key: str | None, headers: dict[str, str]) -> dict[str, str]:
    """The headers every request carries: Authorization from the key, then --header (which wins)."""
    out = {"Authorization": f"Bearer {key}"} if key else {}
    if any(k.lower() == "authorization" for k in headers):
        out = {}
    out.update(headers)
    return out


def secret_header(name: str) -> bool:
    """Whether a header's value is a credential (Authorization, X-Api-Key, Cookie, ...)."""
    return bool(_SECRET.search(name))


def redacted(headers: dict[str, str]) -> dict[str, str]:
    """`headers` for summary.json: values of credential-like names replaced by REDACTED."""
    return {k: REDACTED if secret_header(k) else v for k, v in headers.items()}
