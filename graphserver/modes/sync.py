"""``sync``: a barrier after every stage (every interval of the partition finishes it before
any starts the next), after every Scatter (all peers' rows of this epoch) and every epoch (the
forward pass computes with the weights of the previous epoch's step). Exact."""

from dataclasses import dataclass

from graphserver.modes import Mode


@dataclass(frozen=True)
class Sync(Mode):
    name = "sync"

    def __post_init__(self) -> None:
        if self.staleness:
            raise ValueError("sync mode has no staleness")

    def may_start(self, epoch: int, min_epoch: int) -> bool:
        return True  # the wait for the previous epoch's weights already holds every interval back

    def barrier_after_stage(self) -> bool:
        return True


MODE = Sync
