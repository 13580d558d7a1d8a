"""Oracle numbers for the tests, each with its provenance (see the module docstrings)."""
