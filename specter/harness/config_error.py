"""The error of a configuration that cannot run, importable without torch (figures, row store)."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""
