"""d_HM: parity with the published VWP figures and the counting rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

from conftest import shared_path
from storyrl.data import ScoreTable, read_scores
from storyrl.eval import dhm


def _vwp_table(name: str) -> ScoreTable:
    return (
        read_scores(shared_path("dhm", "vwp", f"{name}_G.json"), "groovist")
        .merge(read_scores(shared_path("dhm", "vwp", f"{name}_C.csv")))
        .merge(read_scores(shared_path("dhm", "vwp", f"{name}_R.csv")))
    )


def test_published_vwp_llava_figures():
    result = dhm(_vwp_table("gt_test"), _vwp_table("llava_vc_p3"))
    assert result.n == 586
    assert round(result.distances["grounding"], 4) == 0.2295
    assert round(result.distances["coherence"], 4) == 0.2145
    assert round(result.distances["repetition"], 4) == 0.0948
    assert round(result.d_hm, 4) == 0.1796


def _table(**columns) -> ScoreTable:
    ids = list(next(iter(columns.values())))
    return ScoreTable(ids, {m: dict(v) for m, v in columns.items()})


def test_counting_rules_and_tanh():
    human = _table(groovist={"a": 1.0, "b": 0.5, "c": 2.0}, repetition={"a": 0.9, "b": math.nan, "c": 0.8})
    model = _table(groovist={"a": 0.0, "b": 0.5, "d": 1.0}, repetition={"a": 0.7, "b": 0.6, "d": 0.1})
    result = dhm(human, model)
    # only "a" counts: "b" has a NaN, "c"/"d" are in one table only
    assert result.n == 1 and result.story_ids == ["a"] and result.n_excluded == 1
    assert result.distances["grounding"] == pytest.approx(np.tanh(1.0))
    assert result.distances["repetition"] == pytest.approx(0.2)
    assert result.d_hm == pytest.approx((np.tanh(1.0) + 0.2) / 2)
    # selecting one dimension counts "b" again
    only_g = dhm(human, model, ["groovist"])
    assert only_g.n == 2 and set(only_g.summary()) == {"n", "grounding", "d_hm"}


def test_errors():
    human = _table(repetition={"a": 0.9})
    with pytest.raises(ValueError, match="unknown d_HM metric"):
        dhm(human, human, ["bleu"])
    with pytest.raises(ValueError, match="has no 'coherence' column"):
        dhm(human, human, ["coherence"])
