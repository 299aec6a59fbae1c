"""AgentX `hash_ids` decoded per turn with shared prefixes: same values, exact errors in file order."""

from __future__ import annotations

import json

import pytest

from agentkv.trace.formats import limits, load_paths
from agentkv.trace.model import TraceError

BAD = limits.MAX_HASH_ID + 1


def _req(t: float, ids: list) -> dict:
    return {"t": t, "type": "n", "in": 64 * max(1, len(ids)), "out": 1, "hash_ids": ids}


def _write(tmp_path, requests: list[dict], name: str = "x.json"):
    p = tmp_path / name
    p.write_text(json.dumps({"id": "x", "block_size": 64, "requests": requests}))
    return p


def test_turns_share_prefix_ints_and_keep_values(tmp_path):
    big = [10**12 + i for i in range(50)]
    turns = [big[:10], big[:30], big[:30], [*big[:5], 7, *big[6:20]], big[:50], []]
    sub = {"t": 9.0, "type": "subagent", "duration_ms": 1000, "requests": [_req(0.0, big[:5])]}
    p = _write(tmp_path, [_req(float(i), ids) for i, ids in enumerate(turns)] + [sub])
    (trace,) = load_paths([p])
    got = [r.hash_ids for r in trace.session.requests]
    assert got == turns and trace.session.subagents[0].requests[0].hash_ids == big[:5]
    assert got[1][9] is got[0][9] and got[2] is not got[1] and got[2][29] is got[1][29]
    assert got[3][4] is got[2][4] and got[3][5] == 7 and got[4][3] is got[3][3]


@pytest.mark.parametrize("where", ["late", "prefix"])
def test_bad_hash_id_names_the_first_bad_record(tmp_path, where):
    good = [_req(float(i), list(range(i + 1))) for i in range(40)]
    if where == "late":
        good[37]["hash_ids"] = [0, 1, BAD]
        good[39]["hash_ids"] = [-1]
    else:  # a bad id in the prefix shared by the turns after it
        for r in good[3:]:
            r["hash_ids"] = [0, BAD, *r["hash_ids"][2:]]
    good[5]["t"] = None if where == "late" else good[5]["t"]  # a later-found semantic error loses
    p = _write(tmp_path, good)
    rec = "requests[37]" if where == "late" else "requests[3]"
    with pytest.raises(TraceError) as e:
        load_paths([p])
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg and rec in msg and "'hash_ids'" in msg, msg


def test_bad_hash_id_in_a_subagent(tmp_path):
    sub = {
        "t": 9.0,
        "type": "subagent",
        "duration_ms": 1000,
        "requests": [_req(0.0, [1]), _req(1.0, [1, "x"])],
    }
    p = _write(tmp_path, [_req(0.0, [1]), sub])
    with pytest.raises(TraceError, match=r"requests\[1\]\.requests\[1\].*'hash_ids'"):
        load_paths([p])
