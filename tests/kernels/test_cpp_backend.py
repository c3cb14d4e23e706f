"""The C++ extension: built by the install and used by the tests; the package works
without it; its results do not depend on the number of threads or on the instruction set;
its operators check their inputs.

(Parity of every operation with the reference is in tests/kernels/test_kernels_*.py, whole
trajectories in tests/protocol/test_backends.py, both shared with the Triton kernels.)"""
import contextlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import poco_kernels as pk
from helpers import Problem, mlp, run
from poco_kernels.kernels import interface as K
from poco_kernels.kernels import cpp_status

DISABLED = os.environ.get("POCO_KERNELS_NO_EXTENSION") == "1"
needs_cpp = pytest.mark.skipif(cpp_status() is not None,
                               reason=f"C++ extension unavailable: {cpp_status()}")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.skipif(DISABLED, reason="POCO_KERNELS_NO_EXTENSION=1 asks for a run without it")
def test_the_extension_is_built_and_auto_picks_it_for_cpu_parameters():
    """CI installs the package with the README's command: the extension must be there
    (not silently replaced by the torch backend)."""
    assert cpp_status() is None, cpp_status()
    assert pk.IVONPoCo(mlp().parameters(), lr=0.1, ess=10.0).backend == "cpp"
    assert pk.SVRG(mlp().parameters(), lr=0.1).backend == "cpp"
    # what the C++ kernels do not run goes to the torch backend
    assert pk.IVON(mlp(dtype=torch.float64).parameters(), lr=0.1, ess=10.0).backend == "torch"
    assert pk.VONPoCo(torch.nn.Linear(3, 1).parameters(), ess=10.0).backend == "torch"


def _python(code, **env):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)


WITHOUT = """
    import sys, torch
    {block}
    import poco_kernels as pk
    from poco_kernels.kernels import cpp_status
    print("status:", cpp_status())
    m = torch.nn.Linear(4, 2)
    o = pk.IVONPoCo(m.parameters(), lr=0.1, ess=10.0)
    def closure():
        o.zero_grad()
        loss = m(torch.ones(3, 4)).square().mean()
        loss.backward()
        return loss
    o.step(closure)
    o.refresh([closure])
    o.step(closure)
    print("backend:", o.backend, "steps:", o.step_count)
    try:
        pk.IVON(m.parameters(), lr=0.1, ess=1.0, backend="cpp")
    except RuntimeError as e:
        print("error:", e)
"""


@pytest.mark.parametrize("how", ["disabled", "not built"])
def test_the_package_works_without_the_extension(how):
    """Without the extension (disabled, or missing from the install) 'auto' runs the
    reference, and backend='cpp' is a clear error that names the install step."""
    block = ("sys.modules['poco_kernels._C'] = None   # as if the .so were not there"
             if how == "not built" else "")
    env = {"POCO_KERNELS_NO_EXTENSION": "1"} if how == "disabled" else {}
    r = _python(WITHOUT.format(block=block), **env)
    assert r.returncode == 0, r.stderr
    assert "backend: torch steps: 2" in r.stdout, r.stdout
    err = r.stdout.split("error:", 1)[1]
    assert "backend='cpp' cannot run here" in err
    assert "pip install" in err and "--no-build-isolation" in err, err
    if how == "disabled":
        assert "POCO_KERNELS_NO_EXTENSION" in err


# --------------------------------------------------------------------------- determinism
def _kernel_run(n, ops, steps=5):
    """Three IVON-PoCo steps (independent outer noise, floor, clip, bf16 parameters), one
    with shared noise and the next sample, a refresh, a sample and the noise past 2**32:
    every byte they write."""
    g = torch.Generator().manual_seed(0)
    r = lambda: torch.randn(n, generator=g)  # noqa: E731
    st = dict(mean=r(), mom=r() * 0.1, h=r().abs() + 0.5, g_in=r(), g_at_out=r(), g_out=r(),
              h_out=r(), m_out=r(), sig=r().abs() + 0.1)
    p = torch.empty(n, dtype=torch.bfloat16)
    ctl = torch.tensor([steps, 2, 0, 0])
    flags = K.StepFlags.ivon(hess_corr=True, floor=True, clip=True,
            debias=True).routed(corr=True, ge_in=False, ge_at_out=False, shared_noise=False,
            next_sample=False)
    hp = K.StepHyper.ivon(lr=0.01, beta1=0.9, beta2=0.999, wd=1e-4, ess=50.0, alpha=0.7,
            hess_corr=0.01, floor=0.5, clip=0.4).counted(sign_at_out=1.0, inv_n_in=1.0,
                                                         inv_n_at_out=1.0)
    for _ in range(3):
        ops.step(st["mean"], p, st["mom"], st["h"], st["g_in"], None, st["g_at_out"], None,
                 st["g_out"], st["h_out"], st["m_out"], st["sig"], ctl, None, None,
                 K.StepStreams(7, 5, 9), hp, flags)
    # shared noise and the next sample (the parked default): two draws per tile
    ops.step(st["mean"], p, st["mom"], st["h"], st["g_in"], None, st["g_at_out"], None,
             st["g_out"], st["h_out"], st["m_out"], st["sig"], ctl, None, None,
             K.StepStreams(7, 5, 9), hp, flags._replace(shared_noise=True, next_sample=True))
    ops.refresh(st["mean"], st["h"], st["g_in"], None, st["g_out"], st["h_out"], st["m_out"],
                st["sig"], ctl, None, None, 7, 2, 13,
                K.RefreshHyper.ivon(ess=50.0, wd=1e-4, rho1=0.3, rho2=0.1).counted(inv_n=0.5),
                K.RefreshFlags(K.FAMILY_IVON, ge=False, noisy=True))
    ops.sample(p, st["mean"], st["mean"], st["h"], None, ctl, 7, 2, 21, 0,
               K.SampleHyper(50.0, 1e-4, 0.0), -1.0, K.SIGMA_IVON, False)
    # both noise streams, from offsets where the element (v1) or call (v2) index wraps
    noise = [ops.randn(torch.empty(n), 7, 3, 11, 2 ** 32 - 1000, 1),
             ops.randn(torch.empty(n), 7, 3, 11, 2 ** 34 - 4001, 2)]
    return torch.cat([v.view(-1) for v in st.values()] + [p.float()] + noise)


@needs_cpp
def test_results_do_not_depend_on_the_number_of_threads_or_the_instruction_set():
    """Tiles at fixed offsets, each element computed by the same code whatever tile or
    thread it is in, no fused multiply-adds: identical bits with 1 and 2 threads and on
    every instruction set this CPU runs."""
    from poco_kernels.kernels import cpp_ops as ops
    n = 200_003                      # 1,563 tiles of 128: split between threads
    threads, isa = torch.get_num_threads(), ops.isa()
    runs = {}
    try:
        for name in ops.available_isas():
            ops.set_isa(name)
            for t in (1, 2):
                torch.set_num_threads(t)
                runs[(name, t)] = _kernel_run(n, ops)
    finally:
        torch.set_num_threads(threads)
        ops.set_isa(isa)
    first = next(iter(runs.values()))
    for key, out in runs.items():
        assert torch.equal(out, first), key
    assert len(runs) >= 2
    # guard: the comparison sees a change of the noise counter alone
    assert not torch.equal(_kernel_run(n, ops, steps=6), first)


@contextlib.contextmanager
def _threads(n):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@needs_cpp
def test_whole_trajectories_do_not_depend_on_the_number_of_threads():
    """The optimizer's work (samples, accumulation, steps, refreshes) runs on 1 or 2
    threads; the model's forward and backward always on one (torch's own matmul and
    reductions round differently with the number of threads)."""
    out = []
    for t in (1, 2):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(300, 200), torch.nn.Tanh(),
                                torch.nn.Linear(200, 3))     # 60,803 parameters
        opt = pk.IVONPoCo(m.parameters(), lr=0.05, ess=500.0, beta2=0.999, alpha=0.7,
                          rho1=0.3, rho2=0.1, backend="cpp", seed=1)
        X, Y = torch.randn(64, 300), torch.randint(0, 3, (64,))

        def backward(idx):
            with _threads(1):
                torch.nn.functional.cross_entropy(m(X[idx]), Y[idx]).backward()

        for s in range(6):
            if s % 3 == 1:
                with _threads(t):
                    opt.sample("refresh")
                for chunk in (torch.arange(0, 32), torch.arange(32, 64)):
                    backward(chunk)
                    with _threads(t):
                        opt.accumulate()
                with _threads(t):
                    opt.restore()
                    opt.refresh()
            kinds = ["inner"] * 2 + (["outer"] * 2 if opt.correction_active() else [])
            for kind in kinds:
                with _threads(t):
                    opt.sample(kind)
                backward(torch.arange(8 * s, 8 * s + 8))
                with _threads(t):
                    opt.accumulate()
                    opt.restore()
            with _threads(t):
                opt.step()
        assert opt.refresh_count == 2 and opt.step_count == 6
        out.append(torch.cat([t.clone() for k in ("mean", "h", "momentum", "g_out", "h_out")
                              for t in opt.flat_state(k)]))
    assert torch.equal(out[0], out[1])


# --------------------------------------------------------------------------- the operators
@needs_cpp
def test_instruction_set_selection():
    from poco_kernels.kernels import cpp_ops as ops
    assert ops.isa() in ("base", "avx2", "avx512")
    assert "base" in ops.available_isas()
    with pytest.raises(RuntimeError, match="expected 'base'"):
        ops.set_isa("sse9")
    r = _python("import torch, poco_kernels.kernels.cpp_ops as o; print(o.isa())",
                POCO_KERNELS_CPU_ISA="base")
    assert r.stdout.strip() == "base", r.stderr
    r = _python("import torch, poco_kernels.kernels.cpp_ops as o; o.isa()",
                POCO_KERNELS_CPU_ISA="avx1024")
    assert r.returncode != 0 and "POCO_KERNELS_CPU_ISA" in r.stderr


@needs_cpp
@pytest.mark.parametrize("bad, match", [
    (dict(mean=torch.zeros(10, dtype=torch.float64)), "'mean' must be float32"),
    (dict(g_in=torch.zeros(9)), "'g_in' has 9 elements, expected 10"),
    (dict(param=torch.zeros(10, dtype=torch.int32)), "'param' must be float32, bfloat16 or float16"),
    (dict(s2=None), "'s2' is required"),
    (dict(mean=torch.zeros(20)[::2]), "'mean' must be contiguous"),
    (dict(ctl=torch.zeros(4, dtype=torch.int32)), "'ctl' must be a contiguous CPU int64"),
    (dict(hp=torch.zeros(3, dtype=torch.float64)), "row of 16 hyperparameters"),
    (dict(hp=torch.ones(16)), "float64 CPU row"),
    (dict(noise=3), "noise version must be 1 or 2, got 3"),
])
def test_operators_check_their_inputs(bad, match):
    """A wrong tensor (or hyperparameter row) is a clear error from the operator itself,
    raised before anything is written."""
    import poco_kernels.kernels.cpp_ops  # noqa: F401  (loads the operators)
    n = 10
    a = dict(mean=torch.zeros(n), param=torch.zeros(n), s1=torch.zeros(n), s2=torch.ones(n),
             g_in=torch.zeros(n), ctl=torch.zeros(4, dtype=torch.int64),
             hp=torch.ones(16, dtype=torch.float64),
             noise=2)
    a.update(bad)
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError, match=match):
        torch.ops.poco_kernels_cpp.step(
            a["mean"], a["param"], a["s1"], a["s2"], a["g_in"], None, None, None, None, None,
            None, None, a["ctl"], None, None, 0, a["noise"], 0, 0, a["hp"], K.FAMILY_IVON, 0)
    for k, v in before.items():
        assert torch.equal(a[k], v), k


@needs_cpp
@pytest.mark.parametrize("which", ["mean", "param", "g_in", "ctl", "hp"])
def test_operators_refuse_a_tensor_past_the_end_of_its_storage(which):
    """A tensor whose storage was shrunk after it was made (``untyped_storage().resize_``)
    is refused before anything is read or written: the kernels would run past its end."""
    import poco_kernels.kernels.cpp_ops  # noqa: F401  (loads the operators)
    n = 10
    a = dict(mean=torch.zeros(n), param=torch.zeros(n), s1=torch.zeros(n), s2=torch.ones(n),
             g_in=torch.zeros(n), ctl=torch.zeros(4, dtype=torch.int64),
             hp=torch.ones(16, dtype=torch.float64))
    before = {k: v.clone() for k, v in a.items() if k != which}
    st = a[which].untyped_storage()
    st.resize_(st.nbytes() - a[which].element_size())
    with pytest.raises(RuntimeError, match=f"'{which}' reaches past the end of its storage"):
        torch.ops.poco_kernels_cpp.step(
            a["mean"], a["param"], a["s1"], a["s2"], a["g_in"], None, None, None, None, None,
            None, None, a["ctl"], None, None, 0, 2, 0, 0, a["hp"], K.FAMILY_IVON, 0)
    for k, v in before.items():
        assert torch.equal(a[k], v), k


@needs_cpp
@pytest.mark.parametrize("which", ["grad_scale", "found_inf"])
def test_an_expanded_amp_scalar_is_read_not_refused(which):
    """Of an AMP scalar only its first element is read: an expanded one (stride 0, more
    elements than its storage holds) lies inside its storage and is taken, as a plain
    one-element tensor of the same value is."""
    import poco_kernels.kernels.cpp_ops as ops
    n = 10
    value = {"grad_scale": 2.0, "found_inf": 0.0}[which]
    flags = K.StepFlags.ivon(hess_corr=False, floor=False, clip=False, debias=True).routed(
        corr=False, ge_in=False, ge_at_out=False, shared_noise=False, next_sample=False)
    hp = K.StepHyper.ivon(lr=0.1, beta1=0.9, beta2=0.999, wd=0.0, ess=50.0, alpha=0.0,
                          hess_corr=0.0, floor=0.0, clip=0.0)
    outs = []
    for scalar in (torch.tensor([value]).expand(3), torch.tensor([value])):
        amp = {"grad_scale": None, "found_inf": None, which: scalar}
        a = dict(mean=torch.zeros(n), param=torch.zeros(n), s1=torch.zeros(n),
                 s2=torch.ones(n))
        ops.step(a["mean"], a["param"], a["s1"], a["s2"], torch.full((n,), 0.5), None, None,
                 None, None, None, None, None, torch.zeros(4, dtype=torch.int64),
                 amp["found_inf"], amp["grad_scale"], K.StepStreams(7, 5, 9), hp, flags)
        outs.append(a)
    for k in outs[0]:
        assert torch.equal(outs[0][k], outs[1][k]), k
    assert not torch.equal(outs[0]["mean"], torch.zeros(n))


@needs_cpp
def test_a_bound_call_is_the_operator_call():
    """``_C.bind``/``_C.call`` (a step plan's prepared calls): the operator with the
    arguments converted once, each call the same kernel as ``torch.ops``'s (written
    values, version counters, the operator's own checks), and clear errors."""
    from poco_kernels import _C
    import poco_kernels.kernels.cpp_ops  # noqa: F401  (loads the operators)
    out, ref = torch.empty(1001), torch.empty(1001)
    v = ref._version
    torch.ops.poco_kernels_cpp.randn(ref, 11, 2, 3, 5, 7)
    moved = ref._version - v
    bound = _C.bind("randn", (out, 11, 2, 3, 5, 7))
    v = out._version
    _C.call(bound)
    assert torch.equal(out, ref) and out._version - v == moved
    out.zero_()
    _C.call(bound)
    assert torch.equal(out, ref)
    bad = _C.bind("randn", (out, 11, 3, 3, 5, 7))                 # noise version 3
    with pytest.raises(RuntimeError, match="noise version must be 1 or 2"):
        _C.call(bad)
    with pytest.raises(TypeError, match="takes 6 arguments, 5 given"):
        _C.bind("randn", (out, 11, 2, 3, 5))
    with pytest.raises(RuntimeError):
        _C.bind("no_such_op", ())
    with pytest.raises(ValueError):
        _C.call(object())
    # under a torch function mode the fallback (torch.ops' overload) runs, so the mode
    # sees the call; with no fallback given the bound call goes straight to the kernel
    from torch.overrides import TorchFunctionMode
    seen = []

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))
    op = torch.ops.poco_kernels_cpp.randn.default
    with_fallback = _C.bind("randn", (out, 11, 2, 3, 5, 7), op)
    out.zero_()
    with Seen():
        _C.call(with_fallback)
        _C.call(bound)
    assert seen == [str(op)] and torch.equal(out, ref)
