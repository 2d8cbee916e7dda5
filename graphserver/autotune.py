"""The concurrency autotuner: how many function calls a graph server runs at once.

Between epochs, hill climbing on the epoch time (the Dorylus paper's autotuner changes the
number of concurrent Lambdas from the graph server's queue and idle time without restarting):
while calls queued for a slot, try one more; if the epoch got slower than the best seen by more
than ``tolerance``, step back and hold there. ``None`` from :meth:`update` means no change.
"""

from __future__ import annotations


class Autotuner:
    def __init__(self, low: int, high: int, start: int, tolerance: float = 0.05):
        if not 1 <= low <= start <= high:
            raise ValueError(f"autotuner needs 1 <= low <= start <= high, got {low}, {start}, {high}")
        self.low, self.high, self.value, self.tolerance = low, high, start, tolerance
        self.best: tuple[float, int] | None = None  # (epoch seconds, concurrency)
        self.held = False

    def update(self, epoch_s: float, queued: bool) -> int | None:
        """The concurrency for the next epoch, from this epoch's time and whether calls waited."""
        if self.best is None or epoch_s < self.best[0]:
            self.best = (epoch_s, self.value)
        elif epoch_s > self.best[0] * (1 + self.tolerance) and self.value != self.best[1]:
            self.value, self.held = self.best[1], True  # more was worse: go back and stay
            return self.value
        if not self.held and queued and self.value < self.high:
            self.value += 1
            return self.value
        return None
