"""pytest-benchmark runs of the microbenchmarks (``python -m pytest benchmarks``); not part
of the CI test run (``tests/``)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
