"""Errors a user can cause and fix; every module may raise them without importing the config."""


class ConfigError(ValueError):
    """A configuration the user can fix; the message says how."""


class RequestSettingsError(ValueError):
    """A running request cannot go on because of its own settings (its client can fix them, the server is
    fine): an API client gets a 400, not a 500. Any error that says `invalid_request = True` counts as one."""

    invalid_request = True


# Why a server that is stopping refuses requests and ends those still open: not an engine failure, and said as such
SERVER_STOPPING = "the server is shutting down"


def json_object_setting(value: str | dict, flag: str, example: str) -> dict:
    """A setting given as a JSON object on the command line (a string) or as a dict in Python."""
    import json

    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{flag} is not valid JSON ({error}): give e.g. '{example}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, e.g. '{example}', got {value!r}")
    return value
