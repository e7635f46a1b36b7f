"""Error types for bad input: command-line entry points report them as one line and exit with status 2."""


class UserError(Exception):
    """Bad input (config, data, checkpoint, command line) whose message names the field and the value."""


class SharedUserError(UserError):
    """A UserError that every rank of a distributed run raises alike (after agreeing on it): rank 0 reports it."""
