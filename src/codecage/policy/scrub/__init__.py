"""PII and secret detection, redaction and tokenization of what leaves a sandbox.

The host scrubs: the guest runs code written by someone else, so it is never trusted to
scrub its own output. `Scrubber.scrub` takes the whole captured text of a stream (so a
value written in two pieces is whole again) and, when the host cut the stream at its
output cap, also redacts a tail that could be the start of a sensitive value.
`Scrubber.scrub_value` does the same for JSON-like values (return value, events).
`Vault` is the broker's variant: personal data in upstream tool results becomes stable
tokens (``[EMAIL_1]``) that the sandbox can pass back as tool arguments.

What it is for: accidents (a record printed whole, a token in a traceback, a credential
echoed by an upstream server). It is not a boundary: code that wants to leak a value can
always encode it in a way no detector knows (reversed, split across lines, spelled out).
The OS isolation is the boundary (DESIGN principle 1).

One concern a module: `detectors` (the categories, their matchers and validators),
`tail` (the cap boundary: a text cut inside a value), `values` (walking JSON-like values),
`scrubber` (`Scrubber`, its configuration and results), `vault` (tokenization) and `apply`
(a run's result: which scrubber the settings ask for, and every text of the result through
it). What callers use is named here.
"""

from codecage.policy.scrub.detectors import (
    CATEGORIES,
    MIN_SECRET_CHARS,
    PLACEHOLDERS,
    Category,
    Span,
)
from codecage.policy.scrub.scrubber import (
    Scrubbed,
    ScrubbedValue,
    Scrubber,
    ScrubConfig,
    merge_counts,
)
from codecage.policy.scrub.vault import Vault

__all__ = [
    "CATEGORIES",
    "MIN_SECRET_CHARS",
    "PLACEHOLDERS",
    "Category",
    "ScrubConfig",
    "Scrubbed",
    "ScrubbedValue",
    "Scrubber",
    "Span",
    "Vault",
    "merge_counts",
]
