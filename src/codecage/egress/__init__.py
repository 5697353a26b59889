"""Network egress: the only way out of a sandbox that is allowed network. A host-side proxy,
reached over a Unix socket bound into the sandbox, decides each connection after resolving
its name (rules), adds credentials at the edge, and records every attempt."""
