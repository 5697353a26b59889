"""codecage's build backend: setuptools' own, with everything it writes kept out of the
source tree.

setuptools writes `build/` and `src/codecage.egg-info` into the tree it builds from, so
`pip install /path/to/checkout` changed the checkout and failed on one its user cannot
write ("Cannot update time stamp of directory 'src/codecage.egg-info'"). Each hook here
runs setuptools with an extra distutils config (`DIST_EXTRA_CONFIG`, read after the
project's own) that puts the egg-info, the build tree and the wheel's staging directory
in a temporary directory of its own, removed when the hook returns. The hooks' results
(metadata, wheels, sdists) go where the frontend asked, as before.

A `DIST_EXTRA_CONFIG` the caller set is left in force: they chose where things go.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from setuptools import build_meta as _setuptools

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]


@contextlib.contextmanager
def _outside_the_tree() -> Iterator[None]:
    if os.environ.get("DIST_EXTRA_CONFIG"):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="codecage-build-") as scratch:
        base = Path(scratch)
        config = base / "outside-the-tree.cfg"
        config.write_text(
            f"[egg_info]\negg_base = {base}\n"
            f"[build]\nbuild_base = {base / 'build'}\n"
            f"[bdist_wheel]\nbdist_dir = {base / 'bdist'}\n",
            encoding="utf-8",
        )
        os.environ["DIST_EXTRA_CONFIG"] = str(config)
        try:
            yield
        finally:
            del os.environ["DIST_EXTRA_CONFIG"]


def _wrapped(hook: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        with _outside_the_tree():
            return hook(*args, **kwargs)

    run.__name__ = hook.__name__
    run.__doc__ = hook.__doc__
    return run


get_requires_for_build_wheel = _wrapped(_setuptools.get_requires_for_build_wheel)
get_requires_for_build_sdist = _wrapped(_setuptools.get_requires_for_build_sdist)
get_requires_for_build_editable = _wrapped(_setuptools.get_requires_for_build_editable)
prepare_metadata_for_build_wheel = _wrapped(_setuptools.prepare_metadata_for_build_wheel)
prepare_metadata_for_build_editable = _wrapped(_setuptools.prepare_metadata_for_build_editable)
build_wheel = _wrapped(_setuptools.build_wheel)
build_editable = _wrapped(_setuptools.build_editable)
# An sdist lists its files from the egg-info's SOURCES.txt, made where setuptools expects
# it; building one is not installing, and it is not done from a read-only tree.
build_sdist = _setuptools.build_sdist
