"""``async --staleness S``: no Scatter barrier and no wait for the weight step. Gather reads the
ghost rows present, each tagged with the epoch that produced it, waiting only for rows older
than ``e - S``; a forward pass uses the newest weights at least version ``e - 1 - S``; an
interval starts epoch ``e`` only when ``e <= min_epoch + S``. Weight stashing keeps each
interval's backward on the version its forward used."""

from graphserver.modes import Mode


def mode(staleness: int = 0) -> Mode:
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    return Mode("async", staleness=staleness, gate_epochs=True)
