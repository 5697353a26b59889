"""The sandbox's `codecage.runtime`, seen from the host: for type checkers and editors.

Inside the sandbox, `codecage` is the guest package, so `codecage.runtime` is the package
`codecage/guest/runtime/` itself; here the same names (its `__all__`, taken from it, not
copied) are forwarded to it, so that the modules `codecage gen` writes (which import
`codecage.runtime`) type-check and run on the host. Forwarded on first use, like the
guest's own `logger`: importing this module adds no log handler.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from codecage.guest import runtime as _guest

if TYPE_CHECKING:  # the names, for type checkers: the guest package's __all__
    from codecage.guest.runtime import *  # noqa: F403

__all__ = list(_guest.__all__)


def __getattr__(name: str) -> Any:
    if name in _guest.__all__:
        return getattr(_guest, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
