"""Triton kernels, each with a torch reference beside it. Knows nothing of tiers or the engine."""
