"""Benchmarks: baselines and offline/online comparisons against the Jitney engine."""
