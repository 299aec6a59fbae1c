"""`agentkv simulate --sweep ... --out DIR` writes sweep.html beside the per-point summaries: the
throughput-per-GPU against interactivity curve and one row per point, read from those summaries."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html import unescape

from agentkv.metrics.view import ms
from tests.reportutil import check_axes_fit


def test_sweep_html_has_a_row_and_a_dot_per_point(tmp_path):
    out = tmp_path / "sweep"
    argv = ["simulate", "--lanes", "2", "--max-requests", "12", "--sweep", "lanes=1,3", "--sweep"]
    argv += ["router=round_robin,kv_aware", "--workers", "2", "-q", "--json", "--out", str(out)]
    p = subprocess.run(
        [sys.executable, "-m", "agentkv.cli", *argv], capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    html = (out / "sweep.html").read_text()
    assert "agentkv simulate sweep: 4 points" in html
    for r in rows:
        o, s = r["overrides"], r["summary"]
        name = f"summary-lanes={o['lanes']}-router={o['router']}.json"
        assert (out / name).is_file() and f'href="{name}"' in html
        row = re.search(rf"<tr><td>{o['lanes']}</td><td>{o['router']}</td>(.*?)</tr>", html)
        assert row is not None, (o, html)
        cells = re.findall(r"<td>(.*?)</td>", row.group(1))
        assert cells[:3] == [ms(s["ttft"]["p50"]), ms(s["ttft"]["p99"]), ms(s["tpot"]["p50"])]
        assert cells[7] == f"{s['failed']:,}" and cells[8].startswith("yes" if s["valid"] else "<span")
    # one line per router (the keys after the first), a dot per point with its settings in the tooltip
    tips = [unescape(t) for t in re.findall(r"<circle [^>]*><title>([^<]*)</title>", html)]
    assert len(tips) == 4 and any(t.startswith("lanes=3, router=kv_aware:") for t in tips)
    assert "router=round_robin" in html and "router=kv_aware" in html
    # the interactivity tier: a dashed vertical line at its tok/s per user, a ring per point meeting it
    met = sum(r["summary"]["interactivity"]["met"] for r in rows)
    line = re.search(
        r'points="([\d.]+),([\d.]+) ([\d.]+),([\d.]+)"><title>tier: 20 tok/s per user</title>', html
    )
    assert line is not None and line.group(1) == line.group(3) and 'stroke-dasharray="5 4"' in html
    rings = re.search(r'<g fill="none" stroke="#7c3aed" stroke-width="1.5">(.*?)</g>', html)
    assert (rings.group(1).count("<circle") if rings else 0) == met
    assert check_axes_fit(html) >= 2  # the axes still hold the points and the tier line
