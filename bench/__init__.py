"""Benchmarks and GPU diagnostics of the source tree (not part of the installed package): `python -m bench`."""
