"""The command line: `codecage run | validate | info | doctor | serve | gen | packages`."""

from codecage.cli.app import app, main

__all__ = ["app", "main"]
