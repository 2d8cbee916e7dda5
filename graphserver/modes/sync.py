"""``sync``: a barrier after every stage (every interval of the partition finishes it before
any starts the next), after every Scatter (all peers' rows of this epoch) and every epoch (the
forward pass computes with the weights of the previous epoch's step). Exact."""

from graphserver.modes import Mode


def mode(staleness: int = 0) -> Mode:
    if staleness:
        raise ValueError("sync mode has no staleness")
    return Mode("sync", staleness=0, stage_barrier=True)
