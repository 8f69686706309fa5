"""Benchmarks: ratios measured side by side in one run (absolute numbers on a shared machine mean little)."""
