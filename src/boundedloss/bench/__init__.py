"""Benchmarks behind `boundedloss bench ...`: each prints a table and writes JSON."""
