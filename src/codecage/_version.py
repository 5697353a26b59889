"""codecage's version, in a module of its own at the bottom of the layers: the host, the
self-test's cache key and the faces read it without importing the package's public API
(which imports the library face, which imports them)."""

from __future__ import annotations

__version__ = "0.1.0"
