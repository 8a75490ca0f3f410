"""The prefetch throttle: prefetch kept only where forwards with it are measured faster, probes
lost when it costs more than it hides, and the idle link's read budget; on a fake clock."""

from __future__ import annotations

import pytest

from moeswap.experts.prefetch import (EARLY_FORWARDS, PROBE_FORWARDS, RECHECK_FORWARDS, IdleLink,
                                      Throttle)


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _run_forwards(throttle, clock, n, seconds_on, seconds_off, n_tokens=1) -> list[bool]:
    states = []
    for _ in range(n):
        states.append(throttle.forward(n_tokens))
        clock.now += seconds_on if states[-1] else seconds_off
    return states


def test_throttle_keeps_prefetch_that_pays_and_rechecks_it():
    clock = _Clock()
    t = Throttle(clock)
    states = _run_forwards(t, clock, 2 * PROBE_FORWARDS + 1, 0.75, 1.0)
    # 8 forwards timed off, 8 on (each timed when the next starts), then on again: it won
    assert states == [False] * PROBE_FORWARDS + [True] * PROBE_FORWARDS + [True]
    assert (t.probes, t.probes_won, t.medians) == (1, 1, (0.75, 1.0))
    states = _run_forwards(t, clock, RECHECK_FORWARDS, 0.75, 1.0)
    assert all(states) and t.probes == 1
    assert t.forward(1) is False and t._probing  # probing again, off first


def test_throttle_turns_prefetch_off_when_not_faster_and_backs_off():
    clock = _Clock()
    t = Throttle(clock)
    probe = 1 + 2 * PROBE_FORWARDS
    _run_forwards(t, clock, probe, 0.99, 1.0)  # 1 % faster is inside the margin: off
    assert (t.probes, t.probes_won, t.on) == (1, 0, False)
    states = _run_forwards(t, clock, RECHECK_FORWARDS, 0.99, 1.0)
    assert not any(states)  # off, with no work, for RECHECK_FORWARDS forwards
    # the next probe: off, then on, cut short after EARLY_FORWARDS slower forwards
    states = _run_forwards(t, clock, PROBE_FORWARDS + EARLY_FORWARDS + 1, 1.2, 1.0)
    assert states == [False] * PROBE_FORWARDS + [True] * EARLY_FORWARDS + [False]
    assert t.probes == 2 and t._hold == 2 * RECHECK_FORWARDS  # the pause doubled
    assert t.forwards_on == PROBE_FORWARDS + EARLY_FORWARDS


def test_throttle_times_only_forwards_followed_by_one_of_the_same_size():
    clock = _Clock()
    t = Throttle(clock)
    for n_tokens in (40, 1, 7, 3):  # a prefill, then batch sizes changing: nothing timed
        t.forward(n_tokens)
        clock.now += 100.0
    assert t._times == {True: [], False: []}
    _run_forwards(t, clock, 2 * PROBE_FORWARDS + 1, 0.5, 1.0)
    assert t.medians == (0.5, 1.0)  # the 100 s forwards counted nowhere


def test_idle_link_budget_is_the_off_forwards_idle_time_at_the_read_rate():
    clock = iter([0.0, 0.010, 0.020, 0.030, 0.040, 0.050])
    link = IdleLink(clock=lambda: next(clock))
    read = dict(read_bytes=100_000, read_seconds=0.001)  # 100 MB/s
    link.forward(1, 0.000, on=False, **read)
    assert link.per_forward is None and link.allows()  # nothing timed yet: unlimited
    link.forward(1, 0.006, on=False, **read)  # 10 ms forward, 6 ms stalled: 4 ms idle
    assert link.per_forward == pytest.approx(400_000)  # 4 ms at 100 MB/s
    link.spend(300_000)
    assert link.allows()
    link.spend(200_000)  # the last read may overshoot; then nothing more this forward
    assert not link.allows()
    link.forward(4, 0.010, on=False, **read)  # a forward of another size: not timed
    link.forward(4, 0.019, on=True, **read)  # 10 ms, 9 ms stalled: 1 ms idle
    assert link.per_forward == pytest.approx(250_000)  # the median of 4 and 1 ms
    link.forward(4, 0.029, on=False, **read)  # a forward with prefetch on: not an idle sample
    assert link.per_forward == pytest.approx(250_000) and link.allows()


def test_throttle_loses_a_probe_when_prefetch_costs_more_than_it_hides():
    clock = _Clock()
    t = Throttle(clock)
    _run_forwards(t, clock, PROBE_FORWARDS, 1.0, 1.0)  # the off arm
    for forward in range(PROBE_FORWARDS):  # on forwards timed faster, but costing more than
        assert t.forward(1)                 # they hid: the cost rule alone loses the probe,
        t.cost, t.hidden = t.cost + 0.002, t.hidden + 0.001  # at its end, not before
        clock.now += 0.5
    assert not t.forward(1) and (t.probes, t.probes_won) == (1, 0)
    assert t.forwards_on == PROBE_FORWARDS and t._hold == RECHECK_FORWARDS
