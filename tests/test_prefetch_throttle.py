"""The prefetch throttle: prefetch judged by the store's counts in windows of forwards, kept on
while the read time it hid exceeds what it cost, off for a pause that doubles while it keeps
losing (what the store counts as cost: test_prefetch.py, test_idle_reads.py)."""

from __future__ import annotations

from moeswap.experts.prefetch import MAX_RECHECK, RECHECK_FORWARDS, WINDOW_FORWARDS, Throttle


def _window(t: Throttle, hidden: float, cost: float) -> list[bool]:
    """One window's forwards, each hiding and costing its share -> whether each ran prefetch."""
    states = []
    for _ in range(WINDOW_FORWARDS):
        states.append(t.forward())
        if states[-1]:
            t.hidden += hidden / WINDOW_FORWARDS
            t.cost += cost / WINDOW_FORWARDS
    return states


def test_a_window_that_hides_more_than_it_costs_keeps_prefetch_on():
    t = Throttle()
    assert all(_window(t, hidden=0.030, cost=0.010))  # on from the first forward
    assert all(_window(t, hidden=0.020, cost=0.015))  # judged at the next forward: won
    assert (t.windows, t.windows_won) == (1, 1) and t.last == (0.030, 0.010)
    assert t.forward() and t.last == (0.020, 0.015)  # each window judged by its own counts
    assert (t.windows, t.windows_won, t.forwards_on) == (2, 2, 2 * WINDOW_FORWARDS + 1)


def test_a_losing_window_turns_prefetch_off_for_a_pause_that_doubles():
    t = Throttle()
    _window(t, hidden=0.010, cost=0.010)  # hid no more than it cost: lost
    states = [t.forward() for _ in range(RECHECK_FORWARDS)]
    assert not any(states) and (t.windows, t.windows_won) == (1, 0)
    assert t.hidden == t.cost == 0.0  # the lost window's counts are not carried on
    assert all(_window(t, hidden=0.0, cost=0.001))  # a window on again, lost again
    assert not any(t.forward() for _ in range(2 * RECHECK_FORWARDS))  # the pause doubled
    assert all(_window(t, hidden=0.050, cost=0.001))  # won: the pause back to its start
    assert all(_window(t, hidden=0.0, cost=0.001))
    assert not any(t.forward() for _ in range(RECHECK_FORWARDS))
    assert t.forward() and t.forwards_off == 4 * RECHECK_FORWARDS


def test_the_pause_stops_doubling_at_its_cap():
    t, pauses = Throttle(), []
    _window(t, hidden=0.0, cost=0.001)
    for _ in range(7):  # each window lost: it cost and hid nothing
        off = 0
        while not t.forward():  # the first of these judges the window before
            off += 1
        pauses.append(off)
        t.cost += 0.001
        assert all(t.forward() for _ in range(WINDOW_FORWARDS - 1))
    assert pauses == [min(RECHECK_FORWARDS << i, MAX_RECHECK) for i in range(7)]
