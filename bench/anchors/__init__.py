"""Anchors the benchmarks measure beside our code in the same call: other projects' code, vendored with its licence."""
