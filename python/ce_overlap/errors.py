"""The one exception type the Python API raises for bad input (the CLI turns it into exit code 2)."""


class CeOverlapError(ValueError):
    """Bad input: malformed or invalid IR/profile JSON, unknown model or profile, bad option value,
    a user build() that fails. The message names the problem."""
