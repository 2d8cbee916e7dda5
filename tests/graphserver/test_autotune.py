"""The concurrency autotuner's hill climbing on synthetic epoch-time curves."""

import pytest

from graphserver.autotune import Autotuner


def convex(c: int) -> float:
    """10/c + 0.8c: 10.8, 6.6, 5.73, 5.7, 6.0, 6.47, ... — best integer at c = 4."""
    return 10.0 / c + 0.8 * c


def drive(tuner: Autotuner, cost, epochs: int, queued=True) -> list[int]:
    """Run ``epochs`` epochs; returns the concurrency each epoch ran with (checking the bounds)."""
    used = []
    for _ in range(epochs):
        c = tuner.value
        assert tuner.low <= c <= tuner.high
        used.append(c)
        new = tuner.update(cost(c), queued)
        if new is None:
            assert tuner.value == c  # None means no change
        else:
            assert new == tuner.value and new != c
            assert tuner.low <= new <= tuner.high
    return used


def test_climbs_from_one_to_the_optimum_and_settles():
    tuner = Autotuner(1, 10, 1)
    used = drive(tuner, convex, 30)
    best = min(range(1, 11), key=convex)
    assert best == 4
    assert used[:5] == [1, 2, 3, 4, 5]  # one more per epoch while calls queue
    assert used[5:] == [best] * 25      # 5 was worse than 4 beyond tolerance: back to 4, held
    assert tuner.best == (convex(4), 4)
    assert tuner.held


def test_update_returns_the_new_value_only_on_change():
    tuner = Autotuner(1, 10, 1)
    assert tuner.update(convex(1), True) == 2
    assert tuner.update(convex(2), True) == 3
    assert tuner.update(convex(3), True) == 4
    assert tuner.update(convex(4), True) == 5
    assert tuner.update(convex(5), True) == 4  # step back
    assert tuner.update(convex(4), True) is None
    assert tuner.update(convex(4), True) is None


@pytest.mark.parametrize("low, high, start", [(1, 2, 1), (1, 3, 1), (2, 6, 2), (3, 3, 3), (1, 20, 7), (5, 9, 6)])
def test_never_leaves_bounds(low, high, start):
    tuner = Autotuner(low, high, start)
    used = drive(tuner, convex, 40)
    assert all(low <= c <= high for c in used)
    # with a high bound below the optimum it climbs to the bound and stays
    if high <= 4:
        assert used[-1] == high


def test_ever_faster_curve_stops_at_high():
    tuner = Autotuner(1, 6, 1)
    used = drive(tuner, lambda c: 100.0 / c, 20)
    assert used[:6] == [1, 2, 3, 4, 5, 6]
    assert set(used[6:]) == {6}


def test_more_concurrency_worse_goes_back_and_holds():
    tuner = Autotuner(1, 8, 1)
    used = drive(tuner, lambda c: 1.0 + c, 20)  # every extra call slows the epoch
    assert used[:2] == [1, 2]
    assert used[2:] == [1] * 18
    assert tuner.held and tuner.best == (2.0, 1)


def test_held_value_survives_later_speedups_and_slowdowns():
    tuner = Autotuner(1, 8, 3)
    assert tuner.update(5.0, True) == 4
    assert tuner.update(9.0, True) == 3  # worse: back to 3
    for epoch_s in (4.0, 20.0, 1.0, 50.0):  # noise at the held value never moves it again
        assert tuner.update(epoch_s, True) is None
        assert tuner.value == 3


def test_slower_within_tolerance_keeps_climbing():
    tuner = Autotuner(1, 8, 1, tolerance=0.10)
    times = {1: 10.0, 2: 10.5, 3: 10.9, 4: 12.0}  # 2 and 3 within 10% of the best (10.0), 4 not
    used = drive(tuner, lambda c: times[c], 8)
    assert used[:4] == [1, 2, 3, 4]
    assert used[4:] == [1] * 4


def test_not_queued_never_raises():
    tuner = Autotuner(1, 10, 2)
    used = drive(tuner, convex, 15, queued=False)
    assert used == [2] * 15
    tuner = Autotuner(1, 10, 1)
    for c_queued in [False, False, True, False]:
        before = tuner.value
        tuner.update(convex(before), c_queued)
        assert tuner.value <= before + (1 if c_queued else 0)
    assert tuner.value == 2


def test_not_queued_may_still_step_back():
    tuner = Autotuner(1, 10, 1)
    assert tuner.update(2.0, True) == 2
    assert tuner.update(5.0, False) == 1  # slower, even without queueing: back to the best
    assert tuner.update(2.0, True) is None


def test_deterministic():
    a, b = Autotuner(1, 12, 1), Autotuner(1, 12, 1)
    assert drive(a, convex, 25) == drive(b, convex, 25)


@pytest.mark.parametrize("low, high, start", [
    (0, 4, 1),    # low below 1
    (-1, 4, 1),
    (2, 4, 1),    # start below low
    (1, 4, 5),    # start above high
    (3, 2, 3),    # low above high
    (5, 4, 4),
])
def test_invalid_bounds_raise(low, high, start):
    with pytest.raises(ValueError, match="1 <= low <= start <= high"):
        Autotuner(low, high, start)
