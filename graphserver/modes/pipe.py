"""``pipe``: each interval moves to its next stage as soon as its own data is ready, so the
graph server gathers some intervals while functions run on others; Scatter still ends in a
barrier (all peers' rows of this epoch) and the forward pass waits for the previous epoch's
step. Exact."""

from dataclasses import dataclass

from graphserver.modes import ExactMode


@dataclass(frozen=True)
class Pipe(ExactMode):
    name = "pipe"
    description = "intervals pipelined, Scatter still a barrier"

    def barrier_after_stage(self) -> bool:
        return False


MODE = Pipe
