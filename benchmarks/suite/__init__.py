"""The sections of the benchmark suite (``benchmarks/run.py``): microbenchmarks, memory,
the GPT training step, pretraining throughput; and the microbenchmarks under
pytest-benchmark (``test_micro.py``)."""
