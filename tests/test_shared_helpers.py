"""Helpers that replaced copies (issue 22): each keeps the promise its
docstring makes (break-review survivors r22c)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time

import numpy as np


def test_an_explicit_fallback_of_zero_wins_over_the_environment(monkeypatch):
    from storyrl.integrations.scoring import FALLBACK_ENV, resolve_fallback

    monkeypatch.setenv(FALLBACK_ENV, "-1")
    assert resolve_fallback(0) == 0.0 and resolve_fallback(0.0) == 0.0 and resolve_fallback("0") == 0.0
    assert resolve_fallback(None) == -1.0 and resolve_fallback() == -1.0


def test_restricted_keeps_the_order_of_the_ids_given():
    from storyrl.data import ScoreTable

    table = ScoreTable(["a", "b", "c"], {"m": {"a": 1.0, "b": 2.0, "c": 3.0}})
    kept = table.restricted(["c", "x", "a"])
    assert kept.ids == ["c", "a"] and kept.scores == {"m": {"c": 3.0, "a": 1.0}}
    assert list(kept.scores["m"]) == ["c", "a"]


def test_finite_or_none_turns_every_non_finite_float_into_none():
    from storyrl.training.storyteller.rl.monitor import finite_or_none

    assert [finite_or_none(v) for v in (math.inf, -math.inf, math.nan)] == [None, None, None]
    assert finite_or_none(1.5) == 1.5 and finite_or_none(3) == 3 and finite_or_none("x") == "x"
    json.dumps([finite_or_none(math.inf)], allow_nan=False)


def test_eval_dhm_is_the_function_even_after_its_module_was_imported():
    code = ("import storyrl.eval.dhm\nfrom storyrl.eval import dhm, DHM_DIMENSIONS, DhmResult\n"
            "assert callable(dhm) and not hasattr(dhm, '__file__'), dhm\n"
            "import storyrl.eval as e\nassert e.dhm is dhm and isinstance(DHM_DIMENSIONS, (tuple, list, dict))\n")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)


def test_a_sync_reward_is_never_called_by_two_threads_at_once():
    # verl's reward managers score from several threads: one reward object (its
    # counters, its model) must see one call at a time.
    from storyrl.integrations import scoring

    class Probe:
        __name__ = name = "probe"

        def __init__(self):
            self.inside = 0
            self.overlaps = 0
            self.calls = 0

        def score(self, stories, **context):
            self.inside += 1
            self.calls += 1
            if self.inside > 1:
                self.overlaps += 1
            time.sleep(0.02)
            self.inside -= 1
            return np.ones(len(stories))

        def __call__(self, prompts=None, completions=None, log_extra=None, log_metric=None, **kwargs):
            return list(self.score(completions))

    probe = Probe()
    errors = []

    def worker():
        try:
            scoring.score_stories(probe, ["a story. it ends."])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert probe.calls >= 6 and probe.overlaps == 0
