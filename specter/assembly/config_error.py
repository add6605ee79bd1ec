"""The error of a configuration that cannot run, importable without torch (figures, row store): defined
below the engine (specter/config_error.py) so engine modules can raise it without importing the harness."""

from specter.config_error import ConfigError

__all__ = ["ConfigError"]
