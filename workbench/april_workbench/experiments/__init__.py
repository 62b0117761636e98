"""Experiments that exercise the library (not imported by it): run them from scripts/."""
