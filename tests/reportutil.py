"""What a report looks like, for tests: its panels, whether each chart's axes fit its data (read
from the SVG), headless Chromium screenshots with where each chart is, and a small PNG reader
(zlib + numpy; PIL is not a dependency) to tell a drawn panel from a blank one."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import struct
import subprocess
import zlib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest

PANELS = (
    "TTFT over time",
    "TPOT over time",
    "TTFT distribution",
    "TPOT distribution",
    "ITL distribution",
    "E2E latency distribution",
    "Cache hit rate over time",
    "In-flight requests and KV usage",
    "Session swim lanes",
    "Cache hit rate per session tree",
    "Per-session context growth",
)


class _Svgs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.svgs: list[dict] = []

    def handle_starttag(self, tag, attrs):
        if tag == "svg":
            self.svgs.append(dict(attrs))


def _pair(text: str) -> tuple[float, float]:
    a, b = text.split(",")
    return float(a), float(b)


def check_axes_fit(html: str) -> int:
    """Each chart's axis limits hold its data and are not much wider (no panel squeezed against
    zero or an outlier; a log axis within a decade of its data; bars from zero to near their
    tallest); returns how many axes were checked."""
    p = _Svgs()
    p.feed(html)
    checked = 0
    for a in p.svgs:
        for axis in ("x", "y"):
            if f"data-{axis}data" not in a or a.get(f"data-{axis}fixed") == "1":
                continue
            (lo, hi), (dlo, dhi) = _pair(a[f"data-{axis}lim"]), _pair(a[f"data-{axis}data"])
            label = f"{a['aria-label']} {axis}"
            assert lo <= dlo + 1e-9 * abs(dlo) and dhi <= hi + 1e-9 * abs(hi), (label, lo, hi, dlo, dhi)
            if a.get(f"data-{axis}log") == "1":
                assert lo > 0 and dlo / lo < 10 and hi / dhi < 10, (label, lo, hi, dlo, dhi)
            elif a.get(f"data-{axis}bars") == "1":
                assert lo == 0 and dhi / hi >= 0.4, (label, lo, hi, dlo, dhi)
            elif dhi > dlo:
                # the data fill at least 40% of the axis (0 may be kept when the data start near it)
                assert (dhi - dlo) / (hi - lo) >= 0.4, (label, lo, hi, dlo, dhi)
            checked += 1
    return checked


FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
    "--enable-logging=stderr",
    "--v=0",
]
# appended to a copy of the page: where each chart is, in CSS pixels (= screenshot pixels)
_RECTS = (
    "<script>var o=document.createElement('pre');o.id='agentkv-rects';o.textContent=JSON.stringify("
    "Array.from(document.querySelectorAll('svg.chart')).map(function(s){var b=s.getBoundingClientRect();"
    "return [s.getAttribute('aria-label'),b.left,b.top+window.scrollY,b.width,b.height];}));"
    "document.body.appendChild(o);console.error('agentkv-probe');</script>"
)  # the console.error proves the console check sees errors: it must appear, and nothing else


def chromium() -> str:
    """The Chromium executable, or skip the test saying why."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if not exe:
        pytest.skip("headless screenshot test: no chromium on PATH (apt-get install chromium)")
    return exe


def run_chromium(exe: str, args: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run Chromium in its own process group; on a hang, kill that group (by the pid we started)."""
    p = subprocess.Popen(
        [exe, *FLAGS, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        pytest.fail(f"chromium did not finish in {timeout:.0f} s (killed)")
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


def screenshot(exe: str, page: Path, shot: Path, height: int = 5000) -> tuple[list, list[str]]:
    """Screenshot `page` 1400 px wide into `shot`; return each chart's (label, x, y, w, h) and the
    console lines the page logged (the probe's own line left out)."""
    probe = page.with_name(page.stem + "-probe.html")
    probe.write_text(page.read_text(encoding="utf-8") + _RECTS, encoding="utf-8")
    p = run_chromium(
        exe,
        [
            f"--user-data-dir={shot.parent / ('profile-' + shot.stem)}",
            f"--window-size=1400,{height}",
            f"--screenshot={shot}",
            "--dump-dom",
            probe.as_uri(),
        ],
    )
    m = re.search(r'<pre id="agentkv-rects">([^<]*)</pre>', p.stdout)
    assert m, f"chromium gave no DOM: rc {p.returncode}, {p.stderr[-500:]}"
    console = [ln for ln in p.stderr.splitlines() if re.search(r":CONSOLE[:(]", ln)]
    assert any("agentkv-probe" in ln for ln in console), f"the console check saw nothing: {p.stderr[-500:]}"
    rects = json.loads(m.group(1).replace("&quot;", '"').replace("&amp;", "&"))
    return rects, [ln for ln in console if "agentkv-probe" not in ln]


def read_png(path: Path, rows: int | None = None) -> np.ndarray:
    """An 8-bit RGB/RGBA PNG (what Chromium writes) as an (h, w, channels) uint8 array, its first
    `rows` rows only when given. Unfilters along anti-diagonals: every pixel of one diagonal
    depends only on earlier ones, so each step is one numpy operation over all rows."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    pos, idat = 8, []
    w = h = bpp = 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, color = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and color in (2, 6) and body[12] == 0, "only 8-bit RGB(A), not interlaced"
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
    h = min(h, rows or h)
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8)[: h * (w * bpp + 1)]
    raw = raw.reshape(h, w * bpp + 1)
    ft, f = raw[:, 0].astype(np.int16), raw[:, 1:].reshape(h, w, bpp).astype(np.int16)
    x = np.zeros((h + 1, w + 1, bpp), dtype=np.int16)  # a zero row above and column to the left
    for k in range(h + w - 1):
        r = np.arange(max(0, k - w + 1), min(h - 1, k) + 1)
        c = k - r
        a, b, ul = x[r + 1, c], x[r, c + 1], x[r, c]
        p = a + b - ul
        pa, pb, pc = np.abs(p - a), np.abs(p - b), np.abs(p - ul)
        paeth = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, ul))
        t = ft[r][:, None]
        pred = np.select([t == 1, t == 2, t == 3, t == 4], [a, b, (a + b) >> 1, paeth], 0)
        x[r + 1, c + 1] = (f[r, c] + pred) & 255
    return x[1:, 1:].astype(np.uint8)


def region_stats(img: np.ndarray, x: float, y: float, w: float, h: float) -> tuple[float, float]:
    """(grey-level standard deviation, share of pixels differing from the most common one) in a box."""
    box = img[int(y) : int(y + h), int(x) : int(x + w), :3].astype(np.int32)
    grey = box.mean(axis=2)
    packed = (box[..., 0] << 16) | (box[..., 1] << 8) | box[..., 2]
    _, counts = np.unique(packed, return_counts=True)
    return float(grey.std()), 1.0 - counts.max() / packed.size
