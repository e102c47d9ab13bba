"""Benchmarks: ``python -m perf.<name>``; each prints progress, writes a report with a PNG plot and
ends its output with one JSON line of figures (ratios against a baseline measured in the same run)."""
