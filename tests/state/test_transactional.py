"""Every public call on an optimizer is a transaction: it completes, or it raises a clear
error and leaves everything exactly as before -- parameter values, ``opt.state``,
``param_groups``, the counters, the pending protocol state (counts, draws, sums), the seed
-- so that the optimizer goes on bit for bit like a *twin* that never made the call.

Here each kind of bad call (:data:`KINDS`: step, refresh, sample/accumulate/restore,
``sampled()``, add_param_group, edited param_groups, zero_grad) goes through the generic
twin runner (``transaction_twins.run_case``) on every optimizer and backend it applies
to, and on IVON-PoCo's copy protocol; and the runner's own checks are shown to fail when
they should.  The other transactional tests in this directory: ``test_failed_updates.py``
(non-finite gradients and exceptions mid-update), ``test_invalid_hyperparameters.py``
(edited groups and refused constructors), ``test_load_state_dict.py`` (refused and valid
state dicts), ``test_group_added_mid_run.py`` (a valid group added with the correction
active); the world and the runner are ``transaction_rig.py`` and ``transaction_twins.py``.

Exceptions to "exactly as before", from the spec:

* an update that reads the gradients and finds them non-finite (raised with
  ``check_finite=True``, or skipped) consumes the pending sums (they are empty after);
* a skipped update may count itself in ``skipped_updates`` (never compared here).

Histories and continuations are written as short op strings, see ``Rig.do``.
"""
import pytest
import torch

from transaction_rig import (ALL, BACKENDS, BATCHES, CHUNKS, CORR, GRAD, GRAD_CORR, INF,
                             MISSPELLED, NAN, NOISY_GRAD, TRITON_PICK, Boom, Rig, _raise_inside,
                             names)
from transaction_twins import _group_edit, _ones, assert_twins, run_case


#: tiny tensors: one thread is faster (and VONPoCo's small LAPACK calls much faster)
pytestmark = pytest.mark.usefixtures("one_thread")


# ============================================================================ cases
def _c(kind, opts, **spec):
    return kind, opts, spec


def _lazy(f):
    """A spec value computed per optimizer name."""
    f._per_name = True
    return f


#: (kind, optimizers, run_case arguments); a value marked _lazy is called with the name
KINDS = [
    # ---------------------------------------------------------------- step
    _c("step-nonfinite-inner", ALL, raises=ValueError, match="non-finite",
       bad=lambda r: r.arm(poke=(NAN, 1, 0, 3)).opt.step(r.closure(2))),
    _c("step-nonfinite-outer", CORR, raises=ValueError, match="non-finite",
       bad=lambda r: r.arm(poke=(INF, 2, 2, 1)).opt.step(r.closure(2))),
    _c("step-skip-nonfinite-inner", GRAD, fused=True, check_finite=False,
       bad=lambda r: r.arm(poke=(NAN, 1, 1, 0)).opt.step(r.closure(2))),
    _c("step-skip-nonfinite-outer", GRAD_CORR, fused=True, check_finite=False,
       bad=lambda r: r.arm(poke=(-INF, 2, 0, 7)).opt.step(r.closure(2))),
    _c("step-found-inf", GRAD,
       bad=lambda r: r.opt.step(r.closure(2), found_inf=_ones())),
    _c("step-found-inf-low-level", GRAD, solo="i2", pending="consumed",
       bad=lambda r: r.opt.step(found_inf=_ones())),
    _c("step-low-level-nonfinite", GRAD, solo="i2", pending="consumed", raises=ValueError,
       match="non-finite", arm=dict(poke=(NAN, 1, 2, 4)), bad=lambda r: r.opt.step()),
    _c("step-low-level-skip-nonfinite", GRAD, fused=True, check_finite=False, solo="i2",
       pending="consumed", arm=dict(poke=(INF, 1, 0, 0)), bad=lambda r: r.opt.step()),
    _c("step-closure-raises-inner", ALL, raises=Boom,
       bad=lambda r: r.arm(boom_at=1).opt.step(r.closure(2))),
    _c("step-closure-raises-outer", CORR, raises=Boom,
       bad=lambda r: r.arm(boom_at=2).opt.step(r.closure(2))),
    _c("step-without-sample", NOISY_GRAD, solo="b2", raises=RuntimeError, match="sample",
       bad=lambda r: r.opt.step()),
    _c("step-without-closure-von", ["VONPoCo"], raises=RuntimeError, match="closure",
       bad=lambda r: r.opt.step()),
    _c("step-without-outer-sample", GRAD_CORR, history="s0 r0 s1 I2", raises=RuntimeError,
       match="outer", cont="O2 S s5 r1 s6 s7", bad=lambda r: r.opt.step()),
    _c("step-closure-with-pending", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       raises=RuntimeError, match="sample|accumulate|protocol",
       bad=lambda r: r.opt.step(r.closure(3))),
    _c("step-inside-sampled", GRAD, raises=RuntimeError, match="restore",
       bad=lambda r: _step_inside_sampled(r)),
    # ---------------------------------------------------------------- refresh
    _c("refresh-nonfinite", CORR, raises=ValueError, match="non-finite",
       bad=lambda r: r.arm(poke=(NAN, 2, 0, 2)).opt.refresh(r.chunks(1))),
    _c("refresh-skip-nonfinite", GRAD_CORR, fused=True, check_finite=False,
       bad=lambda r: r.arm(poke=(NAN, 1, 2, 5)).opt.refresh(r.chunks(1))),
    _c("first-refresh-skip-nonfinite", GRAD_CORR, fused=True, check_finite=False,
       history="s0 s1", bad=lambda r: r.arm(poke=(INF, 2, 0, 1)).opt.refresh(r.chunks(0))),
    _c("refresh-found-inf", GRAD_CORR,
       bad=lambda r: r.opt.refresh(r.chunks(1), found_inf=_ones())),
    _c("first-refresh-found-inf", GRAD_CORR, history="s0 s1",
       bad=lambda r: r.opt.refresh(r.chunks(0), found_inf=_ones())),
    _c("refresh-low-level-nonfinite", GRAD_CORR, solo="f1", pending="consumed",
       raises=ValueError, match="non-finite", arm=dict(poke=(NAN, 2, 1, 1)),
       bad=lambda r: r.opt.refresh()),
    _c("refresh-closure-raises", CORR, raises=Boom,
       bad=lambda r: r.arm(boom_at=2).opt.refresh(r.chunks(1))),
    # a non-finite gradient collected, then the closure raises: the fused backends' flag
    # of it must go with the dropped sums (the next update is not skipped)
    _c("step-closure-nonfinite-then-raises", GRAD_CORR, check_finite=False, raises=Boom,
       bad=lambda r: r.arm(poke=(NAN, 1, 0, 0), boom_at=2).opt.step(r.closure(2))),
    _c("refresh-closure-nonfinite-then-raises", GRAD_CORR, check_finite=False, raises=Boom,
       bad=lambda r: r.arm(poke=(NAN, 1, 0, 0), boom_at=2).opt.refresh(r.chunks(1))),
    # step and refresh gradients are not collected at the same time
    _c("refresh-sample-while-step-pending", GRAD_CORR, history="s0 r0 s1 I2",
       raises=RuntimeError, match="call step", cont="O2 S s5 r1 s6 s7", bad=lambda r: r.opt.sample("refresh")),
    _c("inner-sample-while-refresh-pending", GRAD_CORR, history="s0 r0 s1 f1",
       raises=RuntimeError,
       match="call refresh", bad=lambda r: r.opt.sample("inner")),
    _c("step-while-refresh-pending", GRAD_CORR, history="s0 r0 s1 f1", raises=RuntimeError,
       match="call refresh", bad=lambda r: r.opt.step(r.closure(2))),
    _c("sample-refresh-no-outer-loop", ["IVON"], raises=RuntimeError, match="outer loop",
       bad=lambda r: r.opt.sample("refresh")),
    # AMP arguments
    _c("step-grad-scale-zero", GRAD, raises=ValueError, match="grad_scale",
       bad=lambda r: r.opt.step(r.closure(2), grad_scale=torch.zeros(()))),
    _c("step-grad-scale-nan", GRAD_CORR, raises=ValueError, match="grad_scale",
       bad=lambda r: r.opt.step(r.closure(2), grad_scale=torch.full((), NAN))),
    _c("refresh-grad-scale-negative", GRAD_CORR, raises=ValueError, match="grad_scale",
       bad=lambda r: r.opt.refresh(r.chunks(1), grad_scale=-torch.ones(()))),
    _c("step-grad-scale-2d", GRAD_CORR, raises=ValueError, match="grad_scale",
       bad=lambda r: r.opt.step(r.closure(2), grad_scale=torch.ones(1, 1))),
    _c("step-found-inf-meta", GRAD_CORR, raises=ValueError, match="found_inf",
       bad=lambda r: r.opt.step(r.closure(2), found_inf=torch.ones((), device="meta"))),
    _c("refresh-no-chunks", CORR, raises=ValueError, match="chunk",
       bad=lambda r: r.opt.refresh([])),
    # (step gradients pending: refresh() says to step first; nothing pending: no chunks)
    _c("refresh-nothing-pending", GRAD_CORR, history=_lazy(lambda r: r.warm() + " i2"),
       raises=RuntimeError, match="call step", bad=lambda r: r.opt.refresh()),
    _c("refresh-nothing-collected", GRAD_CORR, raises=ValueError, match="chunk",
       bad=lambda r: r.opt.refresh()),
    _c("refresh-closures-with-pending", GRAD_CORR, history="s0 r0 s1 f2",
       raises=RuntimeError, match="refresh", bad=lambda r: r.opt.refresh(r.chunks(1))),
    _c("refresh-without-outer-loop", ["IVON"], raises=RuntimeError, match="refresh|outer",
       bad=lambda r: r.opt.refresh(r.chunks(0))),
    _c("refresh-inside-sampled", GRAD_CORR, raises=RuntimeError, match="restore",
       bad=lambda r: _refresh_inside_sampled(r)),
    # ---------------------------------------------------------------- sample / accumulate
    _c("sample-bad-kind", GRAD, history=_lazy(lambda r: r.warm() + " i2"), raises=ValueError,
       match="kind", bad=lambda r: r.opt.sample("outter")),
    _c("sample-outer-inactive", GRAD, history="s0 s1", raises=RuntimeError,
       match="refresh|correction", bad=lambda r: r.opt.sample("outer")),
    _c("sample-while-active", GRAD, history=_lazy(lambda r: r.warm() + " +"),
       raises=RuntimeError, match="restore", bad=lambda r: r.opt.sample("inner"),
       cont=_lazy(lambda r: "A2 O2 S " + r.tail())),
    _c("accumulate-without-sample", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       raises=RuntimeError, match=r"sample\(\)", bad=lambda r: r.opt.accumulate()),
    _c("restore-without-sample", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       bad=lambda r: r.opt.restore()),
    _c("low-level-api-refused-von", ["VONPoCo"], raises=RuntimeError, match="closure",
       bad=lambda r: r.opt.sample("inner")),
    _c("sampled-refused-von", ["VONPoCo"], raises=RuntimeError, match="closure",
       bad=lambda r: _enter(r, "inner")),
    # ---------------------------------------------------------------- sampled()
    _c("sampled-raises-inside", GRAD, history=_lazy(lambda r: r.warm() + " I2"), raises=Boom,
       bad=lambda r: _raise_inside(r, "inner", backward=True),
       cont=_lazy(lambda r: "I3 O3 S " + r.tail())),
    _c("sampled-nested", GRAD, raises=RuntimeError, match="restore|already",
       bad=lambda r: _nested(r)),
    _c("sampled-outer-inactive", GRAD, history="s0 s1", raises=RuntimeError,
       match="refresh|correction", bad=lambda r: _enter(r, "outer")),
    _c("sampled-bad-kind", GRAD, raises=ValueError, match="kind",
       bad=lambda r: _enter(r, "bogus")),
    # ---------------------------------------------------------------- add_param_group
    _c("add-group-bad-lr", ALL, raises=ValueError, match="lr",
       bad=lambda r: r.opt.add_param_group({"params": [r.spare], "lr": -1.0})),
    _c("add-group-complex", ALL, raises=ValueError, match="complex",
       bad=lambda r: r.opt.add_param_group(
           {"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))]})),
    _c("add-group-duplicate", ALL, raises=ValueError, match="more than one|already",
       bad=lambda r: r.opt.add_param_group({"params": [r.model[0].weight]})),
    _c("add-group-misspelled-key", ALL, raises=(ValueError, TypeError),
       match=_lazy(lambda name: MISSPELLED[name][1]),
       bad=lambda r: r.opt.add_param_group({"params": [r.spare], MISSPELLED[r.name][0]: 0.1})),
    _c("add-group-float64", GRAD, fused=True, raises=(RuntimeError, ValueError),
       match="float64",
       bad=lambda r: r.opt.add_param_group(
           {"params": [torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]})),
    # ---------------------------------------------------------------- param_groups edited
    _c("edited-group1-step", ALL, raises=ValueError, match=names("lr", 1),
       bad=_group_edit("lr", -1.0, 1, lambda r: r.opt.step(r.closure(2)))),
    _c("edited-group1-step-pending", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       raises=ValueError, match=names("lr", 1),
       bad=_group_edit("lr", NAN, 1, lambda r: r.opt.step())),
    _c("edited-group1-refresh", CORR, raises=ValueError,
       match=names("alpha", 1),
       bad=_group_edit("alpha", 1.5, 1, lambda r: r.opt.refresh(r.chunks(1)))),
    # ---------------------------------------------------------------- zero_grad
    _c("zero-grad-with-pending", GRAD, history=_lazy(lambda r: r.warm() + " i2"),
       bad=lambda r: (r.opt.zero_grad(), r.opt.zero_grad(set_to_none=False))),
    _c("zero-grad-von", ["VONPoCo"], bad=lambda r: r.opt.zero_grad()),
]


def _enter(rig, kind):
    with rig.opt.sampled(kind):
        rig.loss(BATCHES[2]).backward()


def _nested(rig):
    rig.opt.zero_grad()
    with rig.opt.sampled("inner"):
        with rig.opt.sampled("inner"):
            rig.loss(BATCHES[2]).backward()


def _step_inside_sampled(rig):
    rig.opt.zero_grad()
    with rig.opt.sampled("inner"):
        rig.loss(BATCHES[2]).backward()
        rig.opt.step()


def _refresh_inside_sampled(rig):
    rig.opt.zero_grad()
    with rig.opt.sampled("refresh"):
        rig.loss(CHUNKS[0][0]).backward()
        rig.opt.refresh()


#: kinds that only exercise the protocol (the same code for every optimizer of the .grad
#: family): on torch and C++ with IVON-PoCo and SVRG (IVON, VONPoCo where they apply), not
#: with all five
PROTOCOL_ONLY = {"step-closure-with-pending", "step-inside-sampled",
                 "refresh-closures-with-pending", "refresh-inside-sampled",
                 "refresh-nothing-pending", "sample-bad-kind",
                 "sample-outer-inactive", "sample-while-active", "accumulate-without-sample",
                 "restore-without-sample", "sampled-nested", "sampled-outer-inactive",
                 "sampled-bad-kind", "add-group-duplicate", "zero-grad-with-pending",
                 "refresh-no-chunks", "add-group-complex", "refresh-nothing-collected",
                 "refresh-sample-while-step-pending", "inner-sample-while-refresh-pending",
                 "step-while-refresh-pending", "step-grad-scale-2d", "step-found-inf-meta",
                 "refresh-grad-scale-negative", "step-grad-scale-nan"}
PROTOCOL_NAMES = {"IVONPoCo", "SVRG", "VONPoCo", "IVON"}


def _kernel_kind(kind):
    """Kinds where the Triton kernels decide something (skipping an update, the first
    refresh, a group they cannot run, noise after a forgotten draw; a non-finite gradient
    that raises is read by the host code shared with C++).  The rest is host
    code that Triton shares with the C++ backend (``backends/fused.py``), run there."""
    return (any(w in kind for w in ("skip-nonfinite", "found-inf", "first-refresh",
                                    "float64", "sampled-raises", "nonfinite-then-raises"))
            and "meta" not in kind)


def _params():
    out = []
    for kind, opts, spec in KINDS:
        for name in opts:
            for backend in (["torch"] if name == "VONPoCo" else BACKENDS):
                if spec.get("fused") and backend == "torch":
                    continue
                if backend == "triton" and (TRITON_PICK.get(kind) != name
                                            or not _kernel_kind(kind)):
                    continue
                if backend != "triton" and kind in PROTOCOL_ONLY and name not in PROTOCOL_NAMES:
                    continue
                out.append(pytest.param(kind, name, backend, id=f"{kind}-{name}-{backend}"))
    return out


SPECS = {kind: spec for kind, _, spec in KINDS}


@pytest.mark.parametrize("kind, name, backend", _params())
def test_call_is_transactional(kind, name, backend):
    """One (call, bad input) kind of :data:`KINDS` on one optimizer and backend."""
    spec = dict(SPECS[kind])
    spec.pop("fused", None)
    probe = None                          # lazy values need a rig (its warm()/tail())
    for k, v in list(spec.items()):
        if getattr(v, "_per_name", False):
            if k != "match" and probe is None:
                probe = Rig(name, backend)
            spec[k] = v(name) if k == "match" else v(probe)
    run_case(name, backend, **spec)


#: the kinds that run on IVON-PoCo, again with the copy protocol on the C++ backend
#: (``sample_ahead=False``: a sample pass each step, nothing parked; the default runs
#: parked, ``backends/fused_park.py``)
COPY_PROTOCOL = [kind for kind, opts, spec in KINDS
                 if "IVONPoCo" in opts and not spec.get("kw")]


@pytest.mark.parametrize("kind", COPY_PROTOCOL)
def test_the_copy_protocol_is_transactional(kind):
    """One (call, bad input) kind on IVON-PoCo with ``sample_ahead=False``."""
    if "cpp" not in BACKENDS:
        pytest.skip("the C++ backend is not built")
    spec = dict(SPECS[kind])
    spec.pop("fused", None)
    probe = None
    for k, v in list(spec.items()):
        if getattr(v, "_per_name", False):
            if k != "match" and probe is None:
                probe = Rig("IVONPoCo", "cpp", sample_ahead=False)
            spec[k] = v("IVONPoCo") if k == "match" else v(probe)
    run_case("IVONPoCo", "cpp", kw={"sample_ahead": False}, **spec)


def test_the_checks_see_one_element_one_draw_and_one_missed_step():
    """The runner's checks can fail: one float32 ulp in one state element, one draw
    counter, one step the twin did not take."""
    def ulp(r):
        buf = r.opt._buckets[0].buffers["momentum_buffer"].view(-1)
        buf[3] = torch.nextafter(buf[3], torch.tensor(INF))
    with pytest.raises(AssertionError, match=r"momentum_buffer.*1 of 15 elements differ"):
        run_case("SVRG", "torch", bad=ulp)
    with pytest.raises(AssertionError, match=r"draws'\]\[0\]: before 0, after 1"):
        run_case("SVRG", "torch", bad=lambda r: r.opt._pending.draws.__setitem__(0, 1))
    with pytest.raises(AssertionError, match=r"step_count'\]: before 2, after 3"):  # a step taken
        run_case("SVRG", "torch", bad=lambda r: r.opt.step(r.closure(2)))
    a, b = Rig("IVONPoCo", "torch"), Rig("IVONPoCo", "torch")     # the twins' continuation:
    for r in (a, b):                                                # same counters, one
        r.run(r.warm())                                             # mini-batch differs
    a.do("s5")
    b.do("s6")
    with pytest.raises(AssertionError, match=r"optimizer and twin differ:\n  \['params'\]"):
        assert_twins(a, b, "after one step on another batch")
