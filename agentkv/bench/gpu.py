"""NVML GPU monitoring while a local target runs: memory used, utilisation, memory-bandwidth utilisation.

Only when `pynvml` (the nvidia-ml-py package) imports, NVML initialises and the target is on
this host; otherwise `absent_reason` says why, and the summary records the GPU as absent.
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from urllib.parse import urlsplit

import numpy as np


def is_local(url: str) -> bool:
    """True when the target's host is this machine (loopback, or one of this host's addresses)."""
    host = urlsplit(url).hostname or ""
    if host in ("localhost", "", socket.gethostname()):
        return True
    try:
        if ipaddress.ip_address(host).is_loopback:
            return True
    except ValueError:
        pass
    try:
        mine = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
        theirs = {a[4][0] for a in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(mine & theirs)


class GpuMonitor:
    """Samples every NVIDIA GPU on this host; `summary()` gives mean and max per device."""

    def __init__(self, target: str):
        self.absent_reason: str | None = None
        self._nvml = None
        self._handles: list = []
        self._names: list[str] = []
        self._samples: list[list[tuple[float, float, float]]] = []  # per device: (mem GiB, util %, bw %)
        if not is_local(target):
            self.absent_reason = "the target is not on this host"
            return
        try:
            import pynvml
        except ImportError:
            self.absent_reason = "pynvml (nvidia-ml-py) is not installed"
            return
        try:
            pynvml.nvmlInit()
            n = pynvml.nvmlDeviceGetCount()
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(n)]
            self._names = [str(pynvml.nvmlDeviceGetName(h)) for h in self._handles]
        except pynvml.NVMLError as e:
            self.absent_reason = f"NVML unavailable ({e})"
            return
        if not self._handles:
            self.absent_reason = "NVML found no GPU"
            return
        self._nvml = pynvml
        self._samples = [[] for _ in self._handles]

    @property
    def active(self) -> bool:
        return self._nvml is not None

    def sample(self) -> None:
        nv = self._nvml
        if nv is None:
            return
        for h, out in zip(self._handles, self._samples, strict=True):
            try:
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                util = nv.nvmlDeviceGetUtilizationRates(h)
            except nv.NVMLError:
                continue
            out.append((mem.used / 2**30, float(util.gpu), float(util.memory)))

    def summary(self) -> dict | None:
        """Per device: name, samples, mean/max memory used (GiB), utilisation and bandwidth utilisation (%)."""
        if not self.active:
            return None
        devices = []
        for i, (name, ss) in enumerate(zip(self._names, self._samples, strict=True)):
            if not ss:
                continue
            a = np.asarray(ss)
            devices.append(
                {
                    "index": i,
                    "name": name,
                    "samples": len(ss),
                    "mem_used_gib_mean": float(a[:, 0].mean()),
                    "mem_used_gib_max": float(a[:, 0].max()),
                    "util_pct_mean": float(a[:, 1].mean()),
                    "util_pct_max": float(a[:, 1].max()),
                    "mem_bw_util_pct_mean": float(a[:, 2].mean()),
                    "mem_bw_util_pct_max": float(a[:, 2].max()),
                }
            )
        return {"source": "nvml", "devices": devices}

    def close(self) -> None:
        if self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
            self._nvml = None
