"""Benchmarks: load generation, workloads and reports."""
