"""Subcommands of the ``mars`` CLI, one module per area."""
