"""prime-train's error for a user mistake in the config, in a leaf module every other imports.

A ConfigError's message names the key, where it came from and the fix, so the CLI prints one
or two lines and exits 2 instead of a traceback.
"""


class ConfigError(ValueError):
    """A user mistake in the config; the message says what and how to fix it."""
