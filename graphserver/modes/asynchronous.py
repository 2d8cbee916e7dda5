"""``async --staleness S``: no Scatter barrier and no wait for the weight step. Gather reads the
ghost rows present, each tagged with the epoch that produced it, waiting only for rows older
than ``e - S``; a forward pass uses the newest weights at least version ``e - 1 - S``; an
interval starts epoch ``e`` only when ``e <= min_epoch + S``. Weight stashing keeps each
interval's backward on the version its forward used. With S >= 1 an interval's evaluation pass
of epoch ``e`` runs beside its training pass of ``e + 1``, on buffers of its own."""

from dataclasses import dataclass

from graphserver.modes import Mode


@dataclass(frozen=True)
class Async(Mode):
    name = "async"
    description = "no Scatter barrier and no wait for the weight step, bounded by --staleness"
    bounded_staleness = True

    def may_start(self, epoch: int, min_epoch: int) -> bool:
        return epoch <= min_epoch + self.staleness

    def barrier_after_stage(self) -> bool:
        return False

    def evaluates_beside_training(self) -> bool:
        # With S = 0 the gate holds epoch e + 1 until e, its evaluation included, ended everywhere.
        return self.staleness >= 1


MODE = Async
