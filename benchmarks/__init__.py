"""pdctl's benchmark scripts, run from the repository root as modules: ``python -m benchmarks.gateway_overhead``.

``_harness`` holds the shared pieces; ``toy_proxy`` runs as a plain file in its own virtual environment.
"""
