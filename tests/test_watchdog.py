"""The watchdog's bound on a wait for the stages (``WaitBound``), rule by rule; the watchdog
itself against real stage processes is in test_pipeline.py and test_server.py."""

from __future__ import annotations

import math

from pipepool.driver.watchdog import WaitBound


def _warm(bound: WaitBound, waits: list[tuple[int, float]]) -> WaitBound:
    bound.results = 1  # the first result came back: waits are learnt from here on
    for tokens, seconds in waits:
        bound.observed(tokens, seconds)
        bound.results += 1
    return bound


def test_no_bound_before_the_first_result_and_warm_up_room_after_it():
    bound = WaitBound()
    assert bound.seconds(8) == math.inf
    bound.observed(8, 90.0)  # a first step that compiled: not learnt
    bound.results = 1
    assert bound.seconds(8) == WaitBound.WARMUP_S
    _warm(bound, [(8, 0.001)] * WaitBound.WARMUP)
    assert bound.seconds(8) == WaitBound.FLOOR_S


def test_the_bound_is_a_multiple_of_the_longest_recent_wait():
    bound = _warm(WaitBound(), [(64, 1.5)] * 20 + [(64, 3.0)] + [(64, 1.5)] * 20)
    assert bound.seconds(64) == WaitBound.MULTIPLE * 3.0
    _warm(bound, [(64, 1.5)] * WaitBound.WINDOW)  # the 3 s wait is forgotten
    assert bound.seconds(64) == WaitBound.MULTIPLE * 1.5


def test_a_plan_larger_than_any_seen_gets_the_largest_plans_wait_scaled_up():
    bound = _warm(WaitBound(), [(2048, 1.5)] * 10 + [(1, 0.05)] * 10)
    assert bound.seconds(2048) == WaitBound.MULTIPLE * 1.5
    assert math.isclose(bound.seconds(8192), WaitBound.MULTIPLE * 1.5 * 4)


def test_a_recompile_gives_the_next_results_warm_up_room_again():
    bound = _warm(WaitBound(), [(8, 0.001)] * 20)
    bound.rewarm()
    assert bound.seconds(8) == WaitBound.WARMUP_S


def test_a_fixed_bound_is_the_option_plus_10_ms_a_token_and_0_is_none():
    fixed = _warm(WaitBound(5.0), [(8, 0.001)] * 20)
    assert math.isclose(fixed.seconds(100), 5.0 + 1.0)
    assert _warm(WaitBound(0.0), [(8, 0.001)] * 20).seconds(100) == math.inf
    assert WaitBound(0.0).never and not WaitBound(None).never
