"""One IVON-PoCo step as a CUDA graph captures it (``graph_seq``) and its capture
(``capture``): used by the Triton rows of ``micro.py`` and the graph check of
``bench_gpu.py``.  On the CPU the 'graph' is the sequence itself, run eagerly."""
from __future__ import annotations

import torch

from internals import lazy_restore


def graph_seq(opt, params, grads_fixed=None):
    """One IVON-PoCo step as a graph captures it: inner sample, fixed gradients written
    into .grad in place (``grads_fixed``; None: .grad already holds them, e.g. as views of
    the flat gradient buffer), accumulate (grads kept), lazy restore; the same for the
    outer sample; step."""
    def write():
        if grads_fixed is not None:
            for p, g in zip(params, grads_fixed):
                p.grad.copy_(g)

    def seq():
        opt.sample("inner")
        write()
        opt.accumulate(clear_grads=False)
        lazy_restore(opt)
        if opt.correction_active():
            opt.sample("outer")
            write()
            opt.accumulate(clear_grads=False)
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
