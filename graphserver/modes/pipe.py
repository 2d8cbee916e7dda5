"""``pipe``: each interval moves to its next stage as soon as its own data is ready, so the
graph server gathers some intervals while functions run on others; Scatter still ends in a
barrier (all peers' rows of this epoch) and the forward pass waits for the previous epoch's
step. Exact."""

from graphserver.modes import Mode


def mode(staleness: int = 0) -> Mode:
    if staleness:
        raise ValueError("pipe mode has no staleness")
    return Mode("pipe", staleness=0)
