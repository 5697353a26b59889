"""The guest side of codecage: code that runs *inside* the sandbox.

Inside, this directory is mounted read-only at /opt/codecage/codecage, so it is importable
there as the package `codecage`: the bootstrap (run as a script), `codecage.runtime` (what
agent code imports) and `codecage.contract` (the wire version, kinds, paths and caps). It
uses the standard library only and imports nothing from the host side. The host imports
`contract` (one contract, both sides) and a few of the bootstrap's tables, never runs the
guest's code in-process, and re-exports the runtime's names for type checkers
(`codecage.runtime`).
"""
