"""Isolation backends: one module each, chosen by name (see `base.BACKENDS`)."""
