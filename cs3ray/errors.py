"""The one exception type for mistakes a user can fix; the CLI prints it as one line, exit 2."""


class UserError(Exception):
    """Bad input (config, arguments, files, storage, cluster address): the message says what to do."""
