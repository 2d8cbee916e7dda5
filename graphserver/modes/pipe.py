"""``pipe``: each interval moves to its next stage as soon as its own data is ready, so the
graph server gathers some intervals while functions run on others; Scatter still ends in a
barrier (all peers' rows of this epoch) and the forward pass waits for the previous epoch's
step. Exact."""

from dataclasses import dataclass

from graphserver.modes import Mode


@dataclass(frozen=True)
class Pipe(Mode):
    name = "pipe"

    def __post_init__(self) -> None:
        if self.staleness:
            raise ValueError("pipe mode has no staleness")

    def may_start(self, epoch: int, min_epoch: int) -> bool:
        return True  # the wait for the previous epoch's weights already holds every interval back

    def barrier_after_stage(self) -> bool:
        return False


MODE = Pipe
