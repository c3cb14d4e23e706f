"""Checkpoints written before the architecture change (033f673), at commit 720fa9a, must
load and resume bit for bit.

``tests/data/checkpoints_720fa9a.pt`` was written by ``python tests/legacy_checkpoints.py
write`` at 720fa9a (this file, then at the top of tests/).  For every case it holds the problem data, the optimizer's state dict
and the parameters saved mid inner loop (after a refresh, with gradients collected by
``sampled()`` but not yet stepped), and what the optimizer held after continuing for
``CONTINUE`` more steps.  ``check`` rebuilds each optimizer with today's code from the
constructor arguments, loads the saved state dict, continues the same steps and compares
every parameter and state tensor, and the counters, bit for bit.

Only the public API is used, and the gradients are elementwise (no matmul), so nothing
depends on BLAS.  Noise transforms use vectorised log/cos: the write and the check run
with ATen and the C++ kernels pinned to AVX2 (``ENV``), so the bits do not depend on the
CPU having AVX-512 or not.  They still depend on its vendor for the torch backend: MKL
(VON-PoCo's LAPACK, and ATen paths that call MKL) gives other last bits on an Intel CPU
than on the AMD EPYC that wrote the file, even under ``MKL_CBWR=COMPATIBLE``; there the
torch backend's cases are compared to ``OTHER_VENDOR_RTOL`` (the C++ kernels' stay exact).
"""
import copy
import os
import sys

import torch

ENV = {"ATEN_CPU_CAPABILITY": "avx2", "POCO_KERNELS_CPU_ISA": "avx2", "OMP_NUM_THREADS": "1",
       "MKL_CBWR": "COMPATIBLE", "TRITON_INTERPRET": "0"}
FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "checkpoints_720fa9a.pt")
SAVE_AT, CONTINUE, REFRESH_EVERY = 6, 6, 4

# (name, class, constructor keywords, backends); VON-PoCo has no fused kernels.  From the
# tests' optimizer database (tests/optim_db.py, its "legacy" configurations): the keywords
# are what wrote the file, and ``check`` compares them with the file's records
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from optim_db import legacy_cases  # noqa: E402

CASES = legacy_cases()


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    return {"w0": torch.randn(4, 5, generator=g), "b0": torch.randn(3, generator=g),
            "A": torch.randn(8, 4 * 5 + 3, generator=g),
            "C": 0.5 + torch.rand(4 * 5 + 3, generator=g)}


def _params(d):
    return [torch.nn.Parameter(d["w0"].clone()), torch.nn.Parameter(d["b0"].clone())]


def _loss(ps, d, k):
    flat = torch.cat([p.reshape(-1) for p in ps])
    return (d["A"][k % d["A"].shape[0]] * flat).sum() + 0.5 * (d["C"] * flat * flat).sum()


def _make(cls, kw, ps, backend):
    import poco_kernels as pk
    return getattr(pk, cls)([{"params": ps[:1]}, {"params": ps[1:], "lr": kw["lr"] * 0.5}],
                            backend=backend, **kw)


def _closures(opt, ps, d, von):
    def closure(k):
        def c():
            if von:                          # VON-PoCo closures return the loss
                return _loss(ps, d, k)
            opt.zero_grad()
            loss = _loss(ps, d, k)
            loss.backward()
            return loss
        return c
    return closure


def cls_has_refresh(opt):
    return type(opt).__name__ != "IVON"


def _refresh_due(t):
    return t >= 2 and (t - 2) % REFRESH_EVERY == 0


def _run(opt, ps, d, von, start, stop, *, pause=False, resumed=False):
    """Steps ``start..stop-1`` with a refresh on 3 chunks every REFRESH_EVERY steps from
    step 2.  ``pause``: at the last step collect the inner gradient with ``sampled()`` and
    return before stepping.  ``resumed``: the optimizer holds step ``start``'s inner
    gradient (and its refresh is done): collect the outer one and step."""
    closure = _closures(opt, ps, d, von)
    for t in range(start, stop):
        mid = resumed and t == start and not von
        if _refresh_due(t) and not mid and cls_has_refresh(opt):
            opt.refresh([closure(100 + j) for j in range(3)])
        if von:
            opt.step(closure(t))
            continue
        if not mid:
            with opt.sampled("inner"):
                _loss(ps, d, t).backward()
            if pause and t == stop - 1:
                return
        if opt.correction_active():
            with opt.sampled("outer"):
                _loss(ps, d, t).backward()
        opt.step()


def _state(opt, ps):
    sd = opt.state_dict()
    return {"params": [p.detach().clone() for p in ps],
            "state": {i: {k: v.clone() for k, v in s.items()} for i, s in sd["state"].items()},
            "poco": {k: sd["poco"][k] for k in ("step", "refreshes", "seed")},
            "bucket_buffers": {k: v.clone() for k, v in sd["poco"]["bucket_buffers"].items()}}


def write():
    out = []
    for name, cls, kw, backends in CASES:
        for backend in backends:
            d = _data(len(out) + 1)
            ps = _params(d)
            opt = _make(cls, kw, ps, backend)
            von = cls == "VONPoCo"
            _run(opt, ps, d, von, 0, SAVE_AT + 1, pause=True)
            saved = copy.deepcopy({"state_dict": opt.state_dict(),
                                   "params": [p.detach() for p in ps]})
            _run(opt, ps, d, von, SAVE_AT + von, SAVE_AT + CONTINUE, resumed=True)
            out.append({"name": name, "cls": cls, "kw": kw, "backend": backend, "data": d,
                        "saved": saved, "final": _state(opt, ps)})
    torch.save(out, FILE)
    print(f"wrote {len(out)} cases to {FILE}")


#: the CPU vendor the checkpoints were recorded on (an AMD EPYC with AVX2)
RECORDED_VENDOR = "AuthenticAMD"
#: the torch backend on another vendor's CPU: MKL (LAPACK for VON-PoCo, and other ATen
#: paths) gives other last bits there even under MKL_CBWR=COMPATIBLE (measured on an Intel
#: Xeon: 3e-8 at most, after 6 resumed steps); the C++ kernels stay bit for bit everywhere
OTHER_VENDOR_RTOL, OTHER_VENDOR_ATOL = 1e-5, 1e-7


def cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def check():
    cases = torch.load(FILE, weights_only=False)
    bad = []
    recorded = [(c["name"], c["cls"], c["kw"], c["backend"]) for c in cases]
    declared = [(n, cls, kw, b) for n, cls, kw, backends in CASES for b in backends]
    if recorded != declared:
        bad.append(f"the cases declared (CASES, from tests/optim_db.py) are not those the file "
                   f"was written from: {declared} != {recorded}")
    exact_torch = cpu_vendor() == RECORDED_VENDOR
    for c in cases:
        d = c["data"]
        ps = [torch.nn.Parameter(t.clone()) for t in c["saved"]["params"]]
        opt = _make(c["cls"], c["kw"], ps, c["backend"])
        opt.load_state_dict(c["saved"]["state_dict"])
        von = c["cls"] == "VONPoCo"
        _run(opt, ps, d, von, SAVE_AT + von, SAVE_AT + CONTINUE, resumed=True)
        got, exp = _state(opt, ps), c["final"]
        tag = f"{c['name']}/{c['backend']}"
        exact = exact_torch or c["backend"] != "torch"

        def same(a, b):
            if exact or not (a.is_floating_point() and b.is_floating_point()):
                return torch.equal(a, b)
            return a.shape == b.shape and torch.allclose(a, b, rtol=OTHER_VENDOR_RTOL,
                                                         atol=OTHER_VENDOR_ATOL)
        for i, (a, b) in enumerate(zip(got["params"], exp["params"])):
            if not same(a, b):
                bad.append(f"{tag}: parameter {i} differs by {(a - b).abs().max():.3g}")
        if got["poco"] != exp["poco"]:
            bad.append(f"{tag}: counters {got['poco']} != {exp['poco']}")
        for i, s in exp["state"].items():
            for k, v in s.items():
                if not same(got["state"][i][k], v):
                    bad.append(f"{tag}: state {i}/{k} differs")
        for k, v in exp["bucket_buffers"].items():
            if not same(got["bucket_buffers"][k], v):
                bad.append(f"{tag}: bucket buffer {k} differs")
    how = "" if exact_torch else f" (torch backend to rtol {OTHER_VENDOR_RTOL}: a {cpu_vendor()} CPU)"
    print("\n".join(bad) if bad else f"ok: {len(cases)} cases{how}")
    return not bad


if __name__ == "__main__":
    sys.exit(0 if {"write": write, "check": check}[sys.argv[1]]() in (None, True) else 1)
