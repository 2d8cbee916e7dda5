"""``sync``: a barrier after every stage (every interval of the partition finishes it before
any starts the next), after every Scatter (all peers' rows of this epoch) and every epoch (the
forward pass computes with the weights of the previous epoch's step). Exact."""

from dataclasses import dataclass

from graphserver.modes import ExactMode


@dataclass(frozen=True)
class Sync(ExactMode):
    name = "sync"
    description = "a barrier after every task stage and Scatter"

    def barrier_after_stage(self) -> bool:
        return True


MODE = Sync
