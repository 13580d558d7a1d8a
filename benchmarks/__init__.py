"""Benchmarks of opacus_rc against Opacus (issue 5). Run from the repository root, e.g.

``python -m benchmarks.layer_norm_cost --quick``; see ``benchmarks/README.md``.
"""
