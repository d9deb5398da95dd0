"""How often a failed pipeline is restarted, and after what delay (no model, no torch)."""

from __future__ import annotations

from pipepool.core.restarts import RestartPolicy


def test_delays_double_until_the_limit_then_give_up():
    policy = RestartPolicy(limit=4, first_delay_s=0.5, max_delay_s=3.0)
    delays = [policy.on_failure(now) for now in (0.0, 1.0, 2.0, 3.0)]
    assert delays == [0.5, 1.0, 2.0, 3.0]  # capped at max_delay_s
    assert policy.on_failure(4.0) is None


def test_failures_older_than_the_window_are_forgotten():
    policy = RestartPolicy(limit=2, window_s=60.0, first_delay_s=1.0)
    assert policy.on_failure(0.0) == 1.0
    assert policy.on_failure(10.0) == 2.0
    # The first failure left the window: this is the second within it, not the third.
    assert policy.on_failure(65.0) == 2.0
    assert policy.on_failure(66.0) is None


def test_limit_zero_never_restarts():
    assert RestartPolicy(limit=0).on_failure(0.0) is None
