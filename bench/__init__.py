"""Benchmarks that print tables (docs/benchmarks.md). Run from the repository root as modules, e.g.
`python -m bench.attention`, so that they import the repository as the commands do."""
