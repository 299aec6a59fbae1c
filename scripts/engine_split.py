"""Where a live vLLM test run's TTFT goes: the replay's engine beside vLLM's engine, and host time.

`python scripts/engine_split.py DIR`: DIR is the live test's `test_calibrated_profile_predic0`
folder (profile.json, run/, traces/, engine_view.json, p/). Prints the replay's own engine TTFT
(first token less arrival, with the profile's delays) beside vLLM's queue + prefill means, the rest
of vLLM's TTFT, the client's lag beyond it, and the predicted host time (client TTFT predicted less
the engine's) in ms; then the engine TPOT predicted beside vLLM's and the client's (issue #17)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from agentkv.calib.predict import engine_config, read_profile
from agentkv.calib.replay import clock_offsets, load_run, replay, trace_requests
from agentkv.errors import UserError
from agentkv.trace.formats import load_paths


def main(d: Path) -> None:
    run, prof = load_run(d / "run"), read_profile(str(d / "profile.json"))
    ns = argparse.Namespace(  # predict's flags as the live test passes them (--block-size 32)
        block_size=32,
        num_gpu_blocks_override=None,
        max_model_len=None,
        max_num_seqs=None,
        profile=str(d / "profile.json"),
    )
    ov = prof["fit"]["overhead"]
    before = ov.get("front_end_before_engine", 0.0) * ov.get("front_end_token_s", 0.0)
    items = trace_requests(run, load_paths(sorted((d / "traces").glob("*.json"))))
    delay = (ov["request_s"], before, ov["per_other_request_s"])
    pred = replay(engine_config(ns, prof, run.config), items, delay, False, clock_offsets(run.records))
    ttft = statistics.fmean(p.first_token - p.arrival for p in pred.values()) * 1e3
    tpot = statistics.fmean((p.end - p.first_token) / (p.output_tokens - 1) for p in pred.values()) * 1e3
    view = json.loads((d / "engine_view.json").read_text())
    e, c = view["engine"], view["client"]
    print(
        f"engine TTFT predicted {ttft:.1f} / vLLM queue + prefill {e['queue'] + e['prefill']:.1f} ms; "
        f"vLLM TTFT less its engine part {e['ttft'] - e['queue'] - e['prefill']:.1f}; client less vLLM "
        f"TTFT {c['ttft'] - e['ttft']:.1f}; predicted host time {c['ttft_pred'] - ttft:.1f}"
    )
    print(f"engine TPOT predicted {tpot:.2f} / vLLM's {e['tpot']:.2f} / client {c['tpot']:.2f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path, help="the live test's test_calibrated_profile_predic0 folder")
    try:
        main(ap.parse_args().dir)
    except (UserError, OSError, KeyError, ValueError) as e:  # not a live test's folder: one line
        sys.exit(f"engine_split: {e}")
