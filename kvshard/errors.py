"""Errors a user can cause and fix; every module may raise them without importing the config."""


class ConfigError(ValueError):
    """A configuration the user can fix; the message says how."""
