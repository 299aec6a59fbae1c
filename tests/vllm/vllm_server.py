"""Start a live vLLM (CPU build) on free loopback ports, wait for /health, stop it by process group.

`VllmServer` is one `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script
needs distribution metadata named `vllm`, which the CPU wheel lacks) with prefix caching, usage
`cached_tokens` and ZMQ KV events on, serving the tiny dummy-weight Llama.

Two departures from a default launch keep the suite light on this 2-core machine: `--enforce-eager`
(no torch.compile warm-up, about 30 s less per start) and the worker inside the engine-core process
(`--distributed-executor-backend uni` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`: two processes
and ~2.5 GB instead of three and ~3.1 GB). Neither touches the prefix cache, its hashing or events.
The API server is a process of its own in both layouts (vLLM's AsyncLLM always runs the engine core
through its multiprocess client); `AGENTKV_VLLM_MULTIPROCESSING=1` (or `ServerSpec.multiprocessing`)
starts vLLM's default layout, the worker in a third process.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

from cluster import free_ports, stop_process
from vllm_env import VllmEnv, kind_dir

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
MAX_MODEL_LEN = 8192
MODEL_NAME = "tiny-llama"


@dataclass(frozen=True, slots=True)
class ServerSpec:
    """What differs between the servers of the suite: hash algorithm, PYTHONHASHSEED, block count.

    `bind_events`: vLLM binds its PUB socket only when the endpoint holds `*` (`tcp://*:PORT`, so
    any number of subscribers connect); otherwise it connects and one subscriber must bind.
    """

    hash_algo: str = "sha256"
    python_hash_seed: str | None = None
    num_gpu_blocks: int | None = None
    bind_events: bool = True
    extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    kind: str | None = None  # a key of vllm_env.TINY_KINDS; None: the tiny Llama
    multiprocessing: bool | None = None  # engine core in its own process; None: $AGENTKV_VLLM_MULTIPROCESSING

    @property
    def served_name(self) -> str:
        return f"tiny-{self.kind}" if self.kind else MODEL_NAME


MAIN = ServerSpec()  # vLLM's defaults: sha256, PYTHONHASHSEED unset; vLLM binds its event socket
EVICT_BLOCKS = 320  # ~10,000 tokens: two agents' contexts (~210 blocks each) do not both fit
EVICT = ServerSpec(
    hash_algo="sha256_cbor", python_hash_seed="4242", num_gpu_blocks=EVICT_BLOCKS, bind_events=False
)


def _amx_tiles() -> bool:
    """Whether this CPU has AMX tiles (vLLM's CPU build picks its MLA backend by them)."""
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


# one evicting server per other model kind (vllm_env.TINY_KINDS), blocks sized so that it starts:
# vLLM needs one request of --max-model-len to fit, and a sliding-window group holds the window plus
# a prefill chunk besides the full-attention blocks. MLA: on a CPU with AMX tiles vLLM serves it with
# AMX_MLA (32-token blocks, prefix caching on), else with its reference CPU_MLA, which forces 16-token
# blocks and turns prefix caching off (the test then skips with vLLM's reason).
# The hybrid (Qwen3-Next: a Gated DeltaNet layer and a full-attention one) gets 96-token blocks, each
# page a 96-token attention block or one state (vLLM's 'align' mode); 110 of them evict.
# The prefill chunk is given explicitly (the CPU build's default) so the simulator can be told the same.
KIND_BLOCKS = {"sliding-window": 360, "moe": 320, "mla": 320 if _amx_tiles() else 640, "hybrid": 110}
KIND_CHUNK = ("--max-num-batched-tokens", "2048")
KIND_SERVERS = {
    f"kind-{kind}": ServerSpec(
        hash_algo="sha256_cbor", num_gpu_blocks=blocks, bind_events=False, extra=KIND_CHUNK, kind=kind
    )
    for kind, blocks in KIND_BLOCKS.items()
}
# vLLM 0.32's --prefix-cache-retention-interval: the window's tail kept at each 1,024-token segment's
# end besides the replay boundary and junctions (the same flag is passed to agentkv simulate)
KIND_SERVERS["kind-sliding-window-retention"] = replace(
    KIND_SERVERS["kind-sliding-window"], extra=(*KIND_CHUNK, "--prefix-cache-retention-interval", "1024")
)


@dataclass
class VllmServer:
    """One live vLLM; `start()` returns once /health answers 200, `stop()` ends its process group."""

    env: VllmEnv
    spec: ServerSpec
    log_dir: Path
    name: str = "vllm"
    port: int = 0
    events_port: int = 0
    replay_port: int = 0
    proc: subprocess.Popen | None = None
    startup_s: float = 0.0
    _log: object = field(default=None, repr=False)

    @property
    def multiprocessing(self) -> bool:
        """vLLM's default layout (engine core and worker in processes of their own) or one process."""
        if self.spec.multiprocessing is not None:
            return self.spec.multiprocessing
        return os.environ.get("AGENTKV_VLLM_MULTIPROCESSING", "0") == "1"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def model_dir(self) -> Path:
        return self.env.model_dir if self.spec.kind is None else kind_dir(self.env, self.spec.kind)

    @property
    def events(self) -> str:
        """Where a subscriber finds the events: connect here (bound by vLLM) or bind here."""
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def argv(self) -> list[str]:
        host = "*" if self.spec.bind_events else "127.0.0.1"
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "topic": "kv-events",
            "endpoint": f"tcp://{host}:{self.events_port}",
            "replay_endpoint": self.replay,
        }
        argv = [
            str(self.env.python),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            str(self.model_dir),
            "--served-model-name",
            self.spec.served_name,
            "--load-format",
            "dummy",
            "--dtype",
            "bfloat16",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo",
            self.spec.hash_algo,
            "--enable-prompt-tokens-details",
            "--kv-events-config",
            json.dumps(kv_events),
            "--enforce-eager",
            "--disable-uvicorn-access-log",
            *self.spec.extra,
        ]
        if not self.multiprocessing:  # vLLM's CPU default with multiprocessing is the "mp" backend
            argv += ["--distributed-executor-backend", "uni"]
        if self.spec.num_gpu_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.spec.num_gpu_blocks)]
        return argv

    def environ(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHONHASHSEED"))}
        env.update(
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CPU_OMP_THREADS_BIND="nobind",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            OMP_NUM_THREADS="1",
            VLLM_ENABLE_V1_MULTIPROCESSING="1" if self.multiprocessing else "0",
            VLLM_SERVER_DEV_MODE="1",
        )  # dev mode: POST /reset_prefix_cache
        env.update(self.spec.env)
        if self.spec.python_hash_seed is not None:
            env["PYTHONHASHSEED"] = self.spec.python_hash_seed
        return env

    def start(self, timeout: float = 600.0, tries: int = 3) -> VllmServer:
        """Launch and wait until healthy. `free_ports` picks ports that vLLM binds seconds later, so
        another process can take one meanwhile (seen in CI: the KV-event replay port, "Address already
        in use"): such a start-up is retried on fresh ports, any other failure raised at once."""
        for attempt in range(tries):
            log = self.log_dir / f"{self.name}.log"
            offset = log.stat().st_size if log.exists() else 0
            try:
                return self._launch(timeout)
            except RuntimeError:
                lost = "Address already in use" in log.read_bytes()[offset:].decode(errors="replace")
                if not lost or attempt == tries - 1:
                    raise
        raise AssertionError("unreachable")

    def _launch(self, timeout: float) -> VllmServer:
        self.port, self.events_port, self.replay_port = free_ports(3)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._log = (self.log_dir / f"{self.name}.log").open("ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv(),
            env=self.environ(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            self._wait_healthy(t0 + timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM ({self.name}) exited with {self.proc.returncode} during start-up:\n"
                    f"{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"vLLM ({self.name}) not healthy in time:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(
                (self.log_dir / f"{self.name}.log").read_text(errors="replace").splitlines()[-lines:]
            )
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        """SIGTERM to the whole process group (API server and engine core), SIGKILL after 30 s."""
        p = self.proc
        if p is not None:
            stop_process(p, 30, group=True)
            with contextlib.suppress(ProcessLookupError):  # stragglers of the group (the engine core)
                os.killpg(p.pid, signal.SIGKILL)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    # -- HTTP helpers -------------------------------------------------------------------------
    def complete(self, prompt: list[int], max_tokens: int = 1, **extra) -> dict:
        """One non-streamed completion of token ids; returns the response JSON."""
        body = {
            "model": self.spec.served_name,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            **extra,
        }
        req = urllib.request.Request(
            self.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (vLLM's dev-mode endpoint), so a run starts from an empty cache."""
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            if r.status != 200:
                raise RuntimeError(f"reset_prefix_cache: HTTP {r.status}")

    def _metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()

    def cache_config(self) -> dict[str, str]:
        """The labels of `vllm:cache_config_info` (block_size, num_gpu_blocks, prefix_caching_hash_algo, ...)."""
        for line in self._metrics_text().splitlines():
            if line.startswith("vllm:cache_config_info{"):
                labels = line[line.index("{") + 1 : line.rindex("}")]
                return dict(re.findall(r'(\w+)="([^"]*)"', labels))
        raise AssertionError("vllm:cache_config_info is missing from /metrics")

    def metrics(self) -> dict[str, float]:
        """`/metrics` summed over label sets, by metric name."""
        out: dict[str, float] = {}
        for line in self._metrics_text().splitlines():
            if not line or line[0] == "#":
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            try:
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except ValueError:
                continue
        return out
