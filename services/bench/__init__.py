"""Benchmarks: offline throughput against baselines, and (services) routing and router overhead."""
