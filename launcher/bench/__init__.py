"""`python -m launcher.bench`: the GPU benchmark harness (see __main__.py)."""
