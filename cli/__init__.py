"""The `cs3` command line: thin typer commands over the cs3ray library."""
