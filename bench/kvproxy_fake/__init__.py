"""Test doubles that ship with the package, so that benchmarks can run them as processes.

Invariant: the proxy runtime (kvproxy/*.py) never imports this package."""
