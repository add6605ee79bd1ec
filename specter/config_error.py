"""The error of a configuration that cannot run, importable without torch and without the harness:
engine modules that read a user's settings (the projection's device files) raise it too. The harness
re-exports it (specter/assembly/config_error.py), so there is one ConfigError class."""


class ConfigError(ValueError):
    """A configuration that cannot run; the message says what to change."""
