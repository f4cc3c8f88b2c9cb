"""The ``tiertune`` command line (typer). Thin: it parses arguments and calls the public API."""
