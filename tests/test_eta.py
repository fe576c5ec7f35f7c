"""The live line's ETA (paratrain/observe/metrics.py, StepPace): a moving average of the recent step times, so a
spike of slow steps moves it by a bounded share and a lasting change of pace shows within a few hundred steps."""

from __future__ import annotations

import re
import time
from types import SimpleNamespace

import pytest

from paratrain.observe import metrics


def eta_seconds(text: str) -> int:
    """The ETA of a live line, in seconds ('ETA 2:50' -> 170)."""
    parts = [int(p) for p in re.search(r"ETA ([\d:]+)$", text).group(1).split(":")]
    return sum(p * 60 ** i for i, p in enumerate(reversed(parts)))


@pytest.fixture
def clock(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics, "time", SimpleNamespace(monotonic=lambda: now[0], time=time.time))
    return now


def test_eta_moves_a_bounded_share_for_a_spike_and_follows_a_lasting_slowdown(clock):
    log = metrics.MetricsLog(None, total_steps=2000, start_step=0, mode="bar")

    def run(steps: range, seconds_per_step: float):
        for step in steps:
            clock[0] += 10 * seconds_per_step
            log.log({"step": step, "loss": 2.0})

    try:
        run(range(10, 310, 10), 0.1)  # steady: 0.1 s per step
        steady = eta_seconds(log.live_text())
        assert steady == pytest.approx(1700 * 0.1, abs=1)
        run(range(310, 320, 10), 1.0)  # a spike: 10 steps at 10x
        spiked = eta_seconds(log.live_text())
        # its pace counts at most 4x, at this interval's share of the weights (6.3% after 290 steps): at most
        # 19% more; a mean since the start would say 30% (the pace of 1690 steps left now, not 1700)
        assert steady < spiked <= 1690 * 0.1 * 1.19 + 1
        run(range(320, 330, 10), 0.1)  # back to the steady pace: the ETA comes back down
        assert eta_seconds(log.live_text()) < spiked
        run(range(330, 740, 10), 0.3)  # a lasting slow-down (a busier machine): 3x for 410 steps
        assert eta_seconds(log.live_text()) >= 1270 * 0.25  # most of the way to the new pace (0.3 s per step)
        clock[0] += 30  # between log steps the ETA counts down
        assert eta_seconds(log.live_text()) == pytest.approx(1270 * log.pace.per_step - 30, abs=1)
    finally:
        log.close()


def test_step_pace_is_the_mean_of_the_first_intervals_and_ignores_empty_ones():
    pace = metrics.StepPace()
    assert pace.per_step is None
    pace.add(10, 1.0)
    assert pace.per_step == pytest.approx(0.1)
    pace.add(0, 50.0)  # a val loss record of the same step: no interval
    pace.add(10, 3.0)  # 0.3 s per step: two intervals of nearly equal weight
    assert pace.per_step == pytest.approx(0.2, rel=0.03)
