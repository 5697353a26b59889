"""Where the config file is looked for (config.py's module docstring says why only there):
the standard library only, so that `codecage run`'s hand-off to the local server
(cli/handoff.py) can name the file this process would load before anything heavy is
imported, by the same rule `config.load` follows."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENV_CONFIG = "CODECAGE_CONFIG"
SYSTEM_CONFIG = Path("/etc/codecage/config.toml")


def candidate_paths(environ: Mapping[str, str]) -> list[tuple[str, Path]]:
    """Where a config file is looked for when none is given, in order, with each place's
    origin (see config.py's module docstring). Never the current directory."""
    paths: list[tuple[str, Path]] = []
    if environ.get(ENV_CONFIG):
        paths.append(("env", Path(environ[ENV_CONFIG])))
    xdg = environ.get("XDG_CONFIG_HOME", "")
    if not Path(xdg).is_absolute():  # the XDG spec: a relative value is invalid, ignore it
        xdg = str(Path.home() / ".config")
    paths += [("user", Path(xdg) / "codecage" / "config.toml"), ("system", SYSTEM_CONFIG)]
    return paths


def chosen(environ: Mapping[str, str]) -> Path | None:
    """The file `config.load` reads when no path is given: the first candidate that exists
    (a dangling link or an unreadable file too: `load` refuses it rather than skip it)."""
    for _, candidate in candidate_paths(environ):
        if os.path.lexists(candidate):
            return candidate
    return None
