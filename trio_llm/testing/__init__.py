"""Helpers shipped for tests and benchmarks (tiny models, process inspection)."""
