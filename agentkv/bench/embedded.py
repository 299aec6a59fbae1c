"""The embedded default target: `agentkv serve` as a child process on a free loopback port.

Started with `--port 0`; its "agentkv serve: URL ..." line says where it listens. Stopped by
its pid: SIGTERM, a grace period, then SIGKILL. Only the process this module started is signalled.
"""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from agentkv.errors import UserError
from agentkv.trace.model import Trace

DEFAULT_GPU = "h200"
DEFAULT_MODEL = "llama3-8b"
START_TIMEOUT_S = 60.0
_READY = re.compile(r"agentkv serve: (http://\S+)")


def needed_model_len(traces: Sequence[Trace]) -> int:
    """The longest prompt + output of any request in `traces` (what max_model_len must hold)."""
    return max(
        (r.input_tokens + max(1, r.output_tokens) for t in traces for s in t.sessions() for r in s.requests),
        default=1,
    )


def _die_with_parent() -> None:
    """In the child, before exec: the kernel sends it SIGTERM if bench dies (even by SIGKILL)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EmbeddedServer:
    """`with EmbeddedServer(...) as srv:` runs `agentkv serve` until the block ends; `srv.url` is its base."""

    def __init__(
        self,
        *,
        time_scale: float = 1.0,
        max_model_len: int | None = None,
        extra_args: str | Sequence[str] = (),
    ):
        args = shlex.split(extra_args) if isinstance(extra_args, str) else list(extra_args)
        self.argv = [
            sys.executable,
            "-m",
            "agentkv.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--time-scale",
            f"{time_scale:g}",
        ]
        if not any(a.startswith("--gpu") for a in args):
            self.argv += ["--gpu", DEFAULT_GPU]
        if not any(a == "--model" or a.startswith("--model=") for a in args):
            self.argv += ["--model", DEFAULT_MODEL]
        if max_model_len and not any(a.startswith("--max-model-len") for a in args):
            self.argv += ["--max-model-len", str(max_model_len)]
        self.argv += args
        self.proc: subprocess.Popen | None = None
        self._log = None
        self.url = ""
        self.description = ""

    def start(self) -> str:
        # output goes to a file, never an unread pipe that could fill up and stall the server
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while time.monotonic() < deadline:
                text = self.log()
                m = _READY.search(text)
                if m:
                    self.url = m.group(1)
                    self.description = next(ln for ln in text.splitlines() if m.group(1) in ln).strip()
                    return self.url
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        except BaseException:  # Ctrl-C while waiting: do not leave the server behind
            self.stop()
            raise
        text = self.log()
        self.stop()
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        why = lines[-1] if lines else f"no ready line within {START_TIMEOUT_S:.0f} s"
        raise UserError(
            f"the embedded 'agentkv serve' did not start: {why} (command: {shlex.join(self.argv[1:])})"
        )

    def log(self) -> str:
        """Everything the server printed so far."""
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode("utf-8", "replace")

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the server by pid, wait up to `grace` seconds, then SIGKILL it."""
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
                p.wait(grace)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
