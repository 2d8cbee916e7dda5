"""What AWS Lambda accepts of a function's configuration. Its own module, below both the training
config that checks a run against it and the local emulator that enforces it."""

MEMORY_RANGE_MB = (128, 10240)
MAX_TIMEOUT_S = 900.0  # the longest function timeout
