"""``async --staleness S``: no Scatter barrier. Training's Gather reads the ghost rows present,
each tagged with the epoch that produced it, waiting only for rows older than ``e - S``; a
training forward pass computes with the previous epoch's weights (version ``e - 1``, as in
sync); an evaluation pass is exact (version ``e``, the peers' rows of epoch ``e``); an interval
starts epoch ``e`` only when ``e <= min_epoch + S``. Weight stashing keeps each
interval's backward on the version its forward used. With S >= 1 an interval's evaluation pass
of epoch ``e`` runs beside its training pass of ``e + 1``, on buffers of its own."""

from dataclasses import dataclass

from graphserver.modes import Mode


@dataclass(frozen=True)
class Async(Mode):
    name = "async"
    description = "no Scatter barrier: ghost rows up to --staleness epochs old"
    bounded_staleness = True

    def may_start(self, epoch: int, min_epoch: int) -> bool:
        return epoch <= min_epoch + self.staleness

    def barrier_after_stage(self) -> bool:
        return False

    def evaluates_beside_training(self) -> bool:
        # With S = 0 the gate holds epoch e + 1 until e, its evaluation included, ended everywhere.
        return self.staleness >= 1


MODE = Async
