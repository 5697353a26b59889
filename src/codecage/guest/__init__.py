"""The guest side of codecage: code that runs *inside* the sandbox.

Inside, this directory is mounted read-only at /opt/codecage/codecage, so it is importable
there as the package `codecage`. It uses the standard library only and imports nothing from
the host side; the host never imports or runs it in-process.
"""
