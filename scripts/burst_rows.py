"""Per-request rows of a predicted bench run whose streams were read in bursts (issue #17).

`python scripts/burst_rows.py RUN_DIR PRED_DIR`: joins requests.jsonl (bench's gaps between chunks
that carried output, `itls`) with predictions.jsonl. A request is burst-delivered when its stream
carried BURST_TOKENS_PER_CHUNK tokens a chunk or more (the server merged several steps' tokens into
one chunk), so its TPOT measures delivery, not steps; gaps under BURST_GAP_S (client read bursts)
are counted too; rows carrying predict's own `merged` flag use it instead. Prints the largest
TPOT/TTFT errors and each figure's MAPE with and without them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

BURST_GAP_S = 0.001
BURST_TOKENS_PER_CHUNK = 3.0


def _mape(rows: list[dict], fig: str) -> tuple[int, float | None]:
    e = [abs(x[f"{fig}_pred"] / x[fig] - 1) * 100 for x in rows if x[fig] and x[f"{fig}_pred"] is not None]
    return len(e), (round(sum(e) / len(e), 1) if e else None)


def main(run: Path, pred: Path) -> None:
    recs = {
        r["id"]: r for r in map(json.loads, (run / "requests.jsonl").read_text().splitlines()) if "id" in r
    }
    rows = [json.loads(x) for x in (pred / "predictions.jsonl").read_text().splitlines()]
    for x in rows:
        itls = recs.get(x["id"], {}).get("itls", [])
        x["burst_share"] = sum(g < BURST_GAP_S for g in itls) / len(itls) if itls else 0.0
        x["per_chunk"] = x["output_tokens"] / (len(itls) + 1)
        # predict's own flag (2 tokens a read or more) when the rows carry it, else this script's rule
        x["burst"] = (
            x["merged"]
            if "merged" in x
            else x["per_chunk"] >= BURST_TOKENS_PER_CHUNK or x["burst_share"] >= 0.5
        )
    for fig in ("tpot", "ttft"):
        top = sorted((x for x in rows if x[fig]), key=lambda x: -abs(x[f"{fig}_pred"] / x[fig] - 1))[:6]
        print(f"largest {fig.upper()} errors:")
        for x in top:
            err = (x[f"{fig}_pred"] / x[fig] - 1) * 100
            print(
                f"  id {x['id']} {x['session']}#{x['index']} in {x['input_tokens']} out {x['output_tokens']}"
                f" cached {x['cached_tokens']}: {fig} {x[fig] * 1e3:.2f} ms pred {x[f'{fig}_pred'] * 1e3:.2f}"
                f" ({err:+.0f}%), {x['per_chunk']:.1f} tokens a chunk, gaps under 1 ms {x['burst_share']:.0%}"
            )
    rest = [x for x in rows if not x["burst"]]
    print(f"burst-delivered requests: {len(rows) - len(rest)} of {len(rows)}")
    for fig in ("ttft", "tpot", "e2e"):
        print(f"{fig.upper()} MAPE: all {_mape(rows, fig)}, without them {_mape(rest, fig)} (n, %)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
