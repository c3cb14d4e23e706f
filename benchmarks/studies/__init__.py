"""Standalone measurements outside the suite, each its own command
(``python benchmarks/studies/<name>.py --help``) with its recorded results under
``benchmarks/results/<topic>/``."""
