"""The sections of the GPU check (``benchmarks/bench_gpu.py``): its configuration, open-loop
and trajectory parity, the steady-state checks, CUDA graphs and torch.compile, the quick
check and its tables."""
