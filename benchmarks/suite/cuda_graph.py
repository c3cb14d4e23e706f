"""One IVON-PoCo step as a CUDA graph captures it (``graph_seq``) and its capture
(``capture``): used by the Triton rows of ``micro.py`` (the graph check of ``bench_gpu.py``
has its own, ``gpu/capture.py``).  On the CPU the 'graph' is the sequence itself, run
eagerly."""
from __future__ import annotations

import torch

from benchmarks.common.internals import lazy_restore


def graph_seq(opt, backward):
    """One IVON-PoCo step as a graph captures it: inner sample, ``backward()`` (a backward
    pass that writes the gradients into ``.grad`` through autograd, as training does),
    accumulate (the gradient buffer lent, not copied), lazy restore; the same for the
    outer sample; step."""
    def seq():
        opt.sample("inner")
        backward()
        opt.accumulate()
        lazy_restore(opt)
        if opt.correction_active():
            opt.sample("outer")
            backward()
            opt.accumulate()
            lazy_restore(opt)
        opt.step()
    return seq


def capture(dev, seq, warm=3):
    """Warm ``seq`` up on a side stream, capture it in a CUDA graph; (replay, None) or
    (None, error).  On the CPU the 'graph' is ``seq`` itself."""
    if dev.type != "cuda":
        for _ in range(warm):
            seq()
        return seq, None
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(warm):
                seq()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            seq()
        torch.cuda.synchronize()
        return g.replay, None
    except Exception as exc:
        try:
            torch.cuda.synchronize()
        except Exception:
            pass
        return None, f"{type(exc).__name__}: {exc}"
