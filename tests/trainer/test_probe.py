"""The weight probe's verdict (trainer/weights/probe.py): equal greedy tokens, or a flip at a near-tie where
the engine's second choice is the trainer's token; anything else, or another weight version, is a
mismatch."""

from __future__ import annotations

import json

from rlslurm.trainer.weights.probe import TIE_LOGPROB, record_probe

TRAINER = [5, 9, 9, 2]


def _engine(tokens, top2=None, version="3"):
    return {"tokens": tokens, "top2": top2 or [[[-0.1, t], [-2.0, 1]] for t in tokens], "weight_version": version}


def test_probe_verdicts(tmp_path) -> None:
    path = tmp_path / "weight_probe.jsonl"
    tie = _engine([5, 7, 3, 3], top2=[[[-0.1, 5], [-2.0, 1]], [[-0.7, 7], [-0.7 - TIE_LOGPROB / 2, 9]],
                                     [[-0.1, 3], [-2.0, 1]], [[-0.1, 3], [-2.0, 1]]])
    far = _engine([5, 7, 3, 3], top2=[[[-0.1, 5], [-2.0, 1]], [[-0.5, 7], [-0.9, 9]], [[-0.1, 3], [-2.0, 1]],
                                      [[-0.1, 3], [-2.0, 1]]])
    other_runner_up = _engine([5, 7, 3, 3], top2=[[[-0.1, 5], [-2.0, 1]], [[-0.7, 7], [-0.7, 4]],
                                                  [[-0.1, 3], [-2.0, 1]], [[-0.1, 3], [-2.0, 1]]])
    # an exact tie that the engine's top-k lists in the other order than its argmax chose
    exact = _engine([5, 7, 3, 3], top2=[[[-0.1, 5], [-2.0, 1]], [[-0.7, 9], [-0.7, 7]],
                                       [[-0.1, 3], [-2.0, 1]], [[-0.1, 3], [-2.0, 1]]])
    cases = [({"a": _engine(TRAINER)}, True, {"a": None}),
             ({"a": exact}, True, {"a": 1}),
             ({"a": _engine(TRAINER), "b": tie}, True, {"a": None, "b": 1}),
             ({"a": _engine(TRAINER), "b": far}, False, {"a": None, "b": None}),
             ({"a": other_runner_up}, False, {"a": None}),
             ({"a": _engine(TRAINER, version="2")}, False, {"a": None}),
             ({"a": _engine(TRAINER), "b": {"error": "ConnectError: refused"}}, False, {"a": None, "b": None}),
             ({}, False, {})]
    for engines, match, ties in cases:
        rec = record_probe(path, 3, TRAINER, engines)
        assert rec["match"] is match, engines
        assert {u: e.get("tie_at") for u, e in rec["engines"].items()} == ties
    lines = [json.loads(l) for l in path.read_text().splitlines()]
    assert [l["match"] for l in lines] == [c[1] for c in cases]
    assert lines[2]["engines"]["b"]["same"] is True and lines[3]["engines"]["b"]["same"] is False
