"""Error types for bad input: command-line entry points report them as one line and exit with status 2."""


class UserError(Exception):
    """Bad input (config, data, checkpoint, command line) whose message names the field and the value."""
