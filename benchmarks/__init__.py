"""The benchmarks, as one package imported from the repository root.

The entry scripts (``run.py``, ``bench_gpu.py`` and each of ``studies/``) put the
repository root on ``sys.path`` when run as scripts, and every module imports its
siblings as ``benchmarks.<folder>.<module>``: ``common`` (shared helpers), ``suite``
(the sections of ``run.py``), ``gpu`` (the sections of ``bench_gpu.py``), ``studies``
(standalone measurements, each its own command).  ``README.md`` has the commands.
"""
