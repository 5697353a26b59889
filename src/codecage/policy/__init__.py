"""Policy layers over the OS boundary: import profiles and the import rule, static
validation, and scrubbing of what leaves a run."""
