"""Reliability under load, faults and hostile input (issue 25)."""
