"""Speed benchmarks: throughput (offline) and serving."""
