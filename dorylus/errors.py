"""User-facing errors: the CLI prints them as one line and exits non-zero, without a traceback."""


class DorylusError(Exception):
    """Base class for errors caused by the user's input (files, options, data): exit status 2."""

    exit_status = 2


class DatasetError(DorylusError):
    """A dataset file or object is missing, malformed or inconsistent."""


class StoreError(DorylusError):
    """A partition store is missing, corrupt or from an incompatible format version."""


class ConfigError(DorylusError):
    """A configuration file or option is unknown or invalid."""
