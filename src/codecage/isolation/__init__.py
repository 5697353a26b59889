"""Kernel-level isolation mechanisms: one module per layer."""
