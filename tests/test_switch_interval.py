"""An open engine lowers the interpreter's thread switch interval (its loop thread must get the
GIL promptly from threads that submit); the last engine closed puts back what it found."""

from __future__ import annotations

import sys

import pytest

import pipepool
from pipepool.runtime import switch_interval


@pytest.fixture
def default_interval():
    saved = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield 0.005
    sys.setswitchinterval(saved)


def test_engines_lower_the_interval_until_the_last_one_closes(bert_path, default_interval):
    first = pipepool.Engine(str(bert_path))
    assert sys.getswitchinterval() == pytest.approx(0.0005)
    second = pipepool.Engine(str(bert_path), switch_interval_ms=0.2)
    assert sys.getswitchinterval() == pytest.approx(0.0002)  # lowered further, never raised
    first.close()
    assert sys.getswitchinterval() == pytest.approx(0.0002)  # the second still runs
    second.close()
    assert sys.getswitchinterval() == pytest.approx(default_interval)
    second.close()  # closing twice restores nothing twice
    assert sys.getswitchinterval() == pytest.approx(default_interval)


def test_zero_leaves_the_interpreter_alone(bert_path, default_interval):
    with pipepool.Engine(str(bert_path), switch_interval_ms=0) as engine:
        assert sys.getswitchinterval() == pytest.approx(default_interval)
        assert engine.embed(["still embeds"]).shape[0] == 1


def test_a_setting_changed_meanwhile_is_not_overwritten(default_interval):
    assert switch_interval.lower(0.001)
    sys.setswitchinterval(0.002)  # the application's own choice, made while an engine ran
    switch_interval.restore()
    assert sys.getswitchinterval() == pytest.approx(0.002)


def test_out_of_range_is_refused():
    with pytest.raises(pipepool.InvalidInputError, match="switch_interval_ms"):
        pipepool.Engine(switch_interval_ms=-1)
