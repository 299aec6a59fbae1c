"""How repeatable a live engine is on this host, beside the model's error (issue #17).

`python scripts/live_repeat.py DIR DIR [DIR ...]`: each DIR holds one predictions.jsonl of the same
bench plan (the live predict test's `test_calibrated_profile_predic0/p`, or any `--predict` output).
Prints, per figure (TTFT, TPOT, E2E), the MAPE between every ordered pair of runs (one run's
measurement taken as the other's prediction), and per run the MAPE of the mean of the other runs'
measurements (a floor no deterministic prediction beats on this host) beside the model's MAPE."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from agentkv.calib.accuracy import FIGURES, repeatability

NEEDED = ("id", *FIGURES, *(f"{f}_pred" for f in FIGURES))


def read_rows(d: Path) -> list[dict]:
    """The rows of DIR/predictions.jsonl (or of the file itself); a bad line is a one-line error."""
    path = d / "predictions.jsonl" if d.is_dir() else d
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            x = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(x, dict) or (miss := [k for k in NEEDED if k not in x]):
            raise ValueError(
                f"{path}:{n}: not a predictions.jsonl row (missing {', '.join(miss) or 'fields'})"
            )
        rows.append(x)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def main(dirs: list[Path]) -> None:
    runs = [read_rows(d) for d in dirs]
    print(f"{len(dirs)} runs of one plan; MAPE % (run-vs-run: median [min-max]; per run: floor / model)")
    show("all requests", runs)
    show(
        "streams read a token a chunk (merged ones left out)",
        [[x for x in r if not x.get("merged")] for r in runs],
    )


def show(title: str, runs: list[list[dict]]) -> None:
    """One block of the table: each figure's run-vs-run MAPE, then floor / model per run."""
    rep = repeatability(runs)
    print(f"{title}:")
    for fig in FIGURES:
        r, pm = rep[fig], rep[fig]["pair_mape_pct"]
        pair = f"{pm['median']:.1f} [{pm['min']:.1f}-{pm['max']:.1f}]" if pm else "-"
        per_run = " ".join(
            f"{_pct(f)}/{_pct(m)}" for f, m in zip(r["floor_mape_pct"], r["model_mape_pct"], strict=True)
        )
        print(f"  {fig.upper():5} run-vs-run {pair}; per run {per_run}")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", type=Path, nargs="+", help="folders with predictions.jsonl (or the files)")
    try:
        main(ap.parse_args().dirs)
    except (OSError, ValueError) as e:
        sys.exit(f"live_repeat: {e}")
