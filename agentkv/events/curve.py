"""ZMQ CURVE for the KV event plane: key files, the publisher's (server's) and the subscriber's
(client's) settings, the allow-list that admits subscribers, and whether an endpoint is exposed.

The worker is always the CURVE server (PUB and replay ROUTER), whichever side binds: it proves its
identity with its secret key, and admits only clients whose public keys it was given. A subscriber
pins the worker's public key, so a process without that worker's secret key can neither publish
to it nor be read from by it. Key files are ZeroMQ's certificate format (`zmq.auth`): `NAME.key`
holds the public key, `NAME.key_secret` both keys.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from agentkv.errors import UserError

log = logging.getLogger("agentkv.events")

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_Z85_KEY_LEN = 40


@dataclass(frozen=True, slots=True)
class CurveServer:
    """The publisher's side: its key pair and the public keys of the subscribers it admits (z85)."""

    public: bytes
    secret: bytes
    allowed: frozenset[bytes]

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_server = True
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


@dataclass(frozen=True, slots=True)
class CurveClient:
    """The subscriber's side: its own key pair and the publisher's pinned public key (z85)."""

    public: bytes
    secret: bytes
    server: bytes

    def apply(self, sock: zmq.Socket) -> None:
        sock.curve_serverkey = self.server
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def _check_key(key: bytes | None, path: Path, what: str, flag: str) -> bytes:
    if key is None or len(key) != _Z85_KEY_LEN:
        raise UserError(f"{flag} {path}: no valid CURVE {what} key (40 z85 characters) in the file")
    try:
        zmq.utils.z85.decode(key)
    except (ValueError, KeyError):
        raise UserError(f"{flag} {path}: the CURVE {what} key is not z85") from None
    return key


def _read(path: Path, flag: str) -> tuple[bytes | None, bytes | None]:
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise UserError(f"{flag} {path}: cannot read a CURVE key file ({e})") from None


def load_keypair(path: str | os.PathLike, flag: str) -> tuple[bytes, bytes]:
    """(public, secret) from a `.key_secret` file, or a UserError naming the flag and file."""
    p = Path(path)
    public, secret = _read(p, flag)
    if secret is None:
        raise UserError(f"{flag} {p}: holds no secret key (give the {SECRET_SUFFIX} file)")
    public, secret = _check_key(public, p, "public", flag), _check_key(secret, p, "secret", flag)
    if zmq.curve_public(secret) != public:
        raise UserError(f"{flag} {p}: the public key is not the secret key's")
    return public, secret


def load_public_key(path: str | os.PathLike, flag: str) -> bytes:
    """The public key of a `.key` (or `.key_secret`) file."""
    p = Path(path)
    return _check_key(_read(p, flag)[0], p, "public", flag)


def load_public_keys(path: str | os.PathLike, flag: str) -> frozenset[bytes]:
    """Public keys from one key file, or from every `*.key` file in a directory (at least one)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob(f"*{PUBLIC_SUFFIX}"))
        if not files:
            raise UserError(f"{flag} {p}: no *{PUBLIC_SUFFIX} files in the directory")
        return frozenset(load_public_key(f, flag) for f in files)
    return frozenset({load_public_key(p, flag)})


def write_keypair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """A new key pair as `DIR/NAME.key` (public) and `DIR/NAME.key_secret` (mode 0600); never overwrites."""
    d = Path(directory)
    if not name or "/" in name or name.startswith("."):
        raise UserError(f"--name {name!r}: expected a plain file name")
    d.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = d / f"{name}{PUBLIC_SUFFIX}", d / f"{name}{SECRET_SUFFIX}"
    for path in (pub_path, sec_path):
        if path.exists():
            raise UserError(f"{path} exists; remove it or choose another --name")
    head = "#   ZeroMQ CURVE {} certificate (agentkv security keys)\n"
    body = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    fd = os.open(sec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(head.format("secret") + body + f'    secret-key = "{secret.decode()}"\n')
    pub_path.write_text(head.format("public") + body)
    return pub_path, sec_path


class Gatekeeper:
    """The ZAP credentials check: admits the allowed public keys, counts (and logs) the others."""

    MAX_LOGGED = 10

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed
        self.denied = 0
        self._lock = threading.Lock()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        with self._lock:
            self.denied += 1
            n = self.denied
        if n <= self.MAX_LOGGED:
            log.warning("KV events: refused a subscriber with an unlisted CURVE key %s", key.decode())
        return False


def start_authenticator(
    ctx: zmq.Context, allowed: frozenset[bytes]
) -> tuple[ThreadAuthenticator, Gatekeeper]:
    """A ZAP handler on `ctx` admitting `allowed` (start it before any socket binds or connects)."""
    gate = Gatekeeper(allowed)
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("agentkv.events.zap"))
    auth.start()
    auth.configure_curve_callback("*", gate)
    return auth, gate


def is_local(endpoint: str) -> bool:
    """True if only this host can reach `endpoint`: ipc / inproc, or a tcp loopback address."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].rsplit(";", 1)[-1].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # `*`, an interface or a host name: assume reachable from elsewhere


def with_host(endpoint: str, host: str | None) -> str:
    """`tcp://*:PORT` -> `tcp://HOST:PORT` (IPv6 in brackets); anything else, or host None, unchanged."""
    if host is None or not endpoint.startswith("tcp://*:"):
        return endpoint
    if host in ("*", "0.0.0.0"):
        return endpoint
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{endpoint[len('tcp://*:') :]}"
