"""The package's structure holds: one typed kernel interface that Python, C++ and Triton
agree on; dependencies that point one way (optimizers -> backends -> kernels) with no
import cycle; backends that reach their optimizer only through the declared members;
optimizer classes without backend branches; constructors that refuse unknown keywords
and document every argument."""
import ast
import inspect
import os
import re

import pytest
import torch

import poco_kernels as pk
from poco_kernels.kernels import interface as I

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "poco_kernels")


# --------------------------------------------------------------------------- kernel interface
def _xmacro(name):
    text = open(os.path.join(ROOT, "csrc", "poco_kernels.h")).read()
    m = re.search(r"#define " + name + r"\(X\)((?:[^\n]*\\\n)*[^\n]*)", text)
    assert m, f"{name} is not in csrc/poco_kernels.h"
    return re.findall(r"X\((\w+)\)", m.group(1))


def _triton_params(kernel):
    from poco_kernels.kernels import triton_kernels as T
    return list(inspect.signature(getattr(getattr(T, kernel), "fn", getattr(T, kernel)))
                .parameters)


def _contiguous(seq, sub):
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


@pytest.mark.parametrize("record, macro", [
    (I.StepHyper, "POCO_STEP_HYPER"), (I.RefreshHyper, "POCO_REFRESH_HYPER"),
    (I.SampleHyper, "POCO_SAMPLE_HYPER")])
def test_cpp_struct_mirrors_the_python_record(record, macro):
    assert _xmacro(macro) == list(record._fields)


@pytest.mark.parametrize("record, macro", [
    (I.StepFlags, "POCO_STEP_FLAGS"), (I.RefreshFlags, "POCO_REFRESH_FLAGS")])
def test_cpp_flag_bits_mirror_the_python_record(record, macro):
    assert record._fields[0] == "family"
    assert _xmacro(macro) == list(record._fields[1:])


def test_triton_kernels_take_the_records_by_name_in_order():
    """The switches are constexpr arguments of the records' names; the hyperparameters a
    row the kernels index by constants whose names and order are the records' (the same
    order csrc/ reads the row in)."""
    from poco_kernels.kernels import triton_kernels as T
    step = _triton_params("step_kernel")
    # (StepStreams.noise, the stream definition, is the constexpr NOISE)
    streams = [f for f in I.StepStreams._fields if f != "noise"]
    assert _contiguous(step, ["hp_ptr", "n", "offset"] + streams), step
    assert "NOISE" in step and "NOISE" in _triton_params("refresh_kernel")
    assert _contiguous(step, [f.upper() for f in I.StepFlags._fields]), step
    refresh = _triton_params("refresh_kernel")
    assert _contiguous(refresh, ["hp_ptr", "n", "offset", "seed", "stream"]), refresh
    assert _contiguous(refresh, [f.upper() for f in I.RefreshFlags._fields]), refresh
    assert "hp_ptr" in _triton_params("sample_kernel")
    for rec, names, prefix in ((I.StepHyper, T.STEP_HP, "S_"), (I.RefreshHyper, T.REFRESH_HP, "R_"),
                               (I.SampleHyper, T.SAMPLE_HP, "P_")):
        assert tuple(names) == rec._fields
        for i, f in enumerate(rec._fields):
            assert getattr(T, prefix + f.upper()).value == i, (rec.__name__, f)


def test_one_record_per_kernel_filled_by_family_then_by_the_engine():
    """The per-family constructors fill the optimizer's fields (the others zero) and leave
    the host engine's at neutral values, which the engine then sets on the same record."""
    hp = I.StepHyper.ivon(lr=0.1, beta1=0.9, beta2=0.99, wd=0.0, ess=1.0, alpha=0.5,
                          hess_corr=0.0, floor=0.0, clip=0.0)
    assert (hp.sign_at_out, hp.inv_n_in, hp.inv_n_at_out) == (1.0, 1.0, 0.0) and hp.momentum == 0.0
    c = hp.counted(sign_at_out=-1, inv_n_in=0.5, inv_n_at_out=0.25)
    assert type(c) is I.StepHyper and c[:3] == (-1.0, 0.5, 0.25) and c[3:] == hp[3:]
    f = I.StepFlags.sgd(momentum=True, nesterov=False)
    assert f.family == I.FAMILY_SGD and not any(f[1:6])
    r = f.routed(corr=True, ge_in=False, ge_at_out=False, shared_noise=False, next_sample=True)
    assert r.corr and r.next_sample and r[6:] == f[6:]
    assert I.StepFlags.ivon(hess_corr=1, floor=0, clip=0, debias=1).family == I.FAMILY_IVON
    assert I.StepFlags.adamw().family == I.FAMILY_ADAMW
    rh = I.RefreshHyper.ivon(ess=2.0, wd=0.1, rho1=0.5, rho2=0.0).counted(inv_n=0.5)
    assert rh.inv_n == 0.5 and rh.sigma == 0.0
    for name in ("StepHP", "StepPath", "RefreshHP"):
        assert not hasattr(I, name), f"{name}: one record per kernel"


def test_a_missing_hyperparameter_is_an_error_not_a_default():
    with pytest.raises(TypeError, match="clip"):
        I.StepHyper.ivon(lr=0.1, beta1=0.9, beta2=0.99, wd=0.0, ess=1.0, alpha=0.0,
                         hess_corr=0.0, floor=0.0)
    with pytest.raises(TypeError):
        I.StepHyper(*([1.0] * 15))
    from poco_kernels.kernels import cpp_status
    if cpp_status() is None:
        from poco_kernels.kernels import cpp_ops
        z = torch.zeros(4)
        with pytest.raises(TypeError, match="StepHyper"):
            cpp_ops.step(z, z, z, z, z, None, None, None, None, None, None, None,
                         torch.zeros(4, dtype=torch.int64), None, None,
                         I.StepStreams(0, 0, 0), [1.0] * 16, I.StepFlags.adamw())


def test_flag_bits_follow_field_order():
    f = I.StepFlags.sgd(momentum=True, nesterov=True).routed(
        corr=True, ge_in=False, ge_at_out=False, shared_noise=False, next_sample=False)
    assert f.bits() == (1 << 0) | (1 << 9) | (1 << 10)
    assert f.constexprs()["FAMILY"] == I.FAMILY_SGD and f.constexprs()["NESTEROV"] is True


# --------------------------------------------------------------------------- import graph
def _modules():
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def _imports(mod, path, modules):
    """Package-internal modules ``mod`` imports (anywhere in the file, functions too)."""
    is_pkg = path.endswith("__init__.py")
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                parts = base[:len(base) - node.level + 1] + (node.module.split(".")
                                                              if node.module else [])
            elif node.module and node.module.split(".")[0] == "poco_kernels":
                parts = node.module.split(".")
            else:
                continue
            target = ".".join(parts)
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.add(sub if sub in modules else target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "poco_kernels":
                    out.add(alias.name)
    return {m for m in out if m in modules and m != mod}


def _graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycles(graph):
    """Every cycle a depth-first search meets, as a list of module names."""
    state, stack, cycles = {}, [], []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    return cycles


def test_the_package_has_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_a_cycle_would_be_found():
    """The search finds a cycle where there is one, and the graph is real: the optimizers
    import the backends, which import the kernels, and imports inside functions count (the
    registry imports its backends lazily)."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    graph = _graph()
    assert "poco_kernels.backends" in graph["poco_kernels._optimizer"]
    assert "poco_kernels.kernels.interface" in graph["poco_kernels.backends.fused"]
    assert "poco_kernels.backends.torch_backend" in graph["poco_kernels.backends"]


OPTIMIZER_MODULES = {"poco_kernels." + m for m in (
    "_optimizer", "_arguments", "_groups", "_state_dict", "_posterior", "_transaction",
    "_step_plan", "_view", "_derivatives", "ivon", "svrg", "von_poco")} | {"poco_kernels"}


def test_dependencies_point_one_way():
    """optimizers -> rules -> kernels and optimizers -> backends -> kernels: a backend
    imports no optimizer module and no rule (it runs the rule it is handed), a rule no
    optimizer module and no backend, the kernels neither."""
    graph = _graph()
    for m, deps in graph.items():
        if m.startswith(("poco_kernels.backends", "poco_kernels.kernels")):
            assert not deps & OPTIMIZER_MODULES, (m, deps & OPTIMIZER_MODULES)
            assert not any(d.startswith("poco_kernels.rules") for d in deps), (m, deps)
        if m.startswith("poco_kernels.rules"):
            assert not deps & OPTIMIZER_MODULES, (m, deps & OPTIMIZER_MODULES)
            assert not any(d.startswith("poco_kernels.backends") for d in deps), (m, deps)
        if m.startswith("poco_kernels.kernels"):
            assert not any(d.startswith("poco_kernels.backends") for d in deps), (m, deps)


def test_a_backend_sees_its_optimizer_only_through_the_view():
    """Backends hold an :class:`OptimizerView` (``self.view``), never the optimizer, and use
    only what the view declares (its public members; ``view._opt`` is not one)."""
    from poco_kernels._view import OptimizerView
    declared = {k for k in vars(OptimizerView) if not k.startswith("_")}
    used = set()
    for f in os.listdir(os.path.join(PKG, "backends")):
        if f.endswith(".py"):
            tree = ast.parse(open(os.path.join(PKG, "backends", f)).read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Attribute):
                    assert node.attr != "opt", f"backends/{f}:{node.lineno} holds an optimizer"
                    v = node.value
                    if (isinstance(v, ast.Attribute) and v.attr == "view"
                            and isinstance(v.value, ast.Name) and v.value.id == "self") or \
                            (isinstance(v, ast.Name) and v.id == "view"):
                        used.add(node.attr)
    assert used, "no view access found: the scan is broken"
    assert used <= declared, sorted(used - declared)


@pytest.mark.parametrize("module", ["_optimizer", "_posterior", "_groups", "_state_dict",
                                    "_transaction", "_step_plan", "ivon", "svrg", "von_poco"])
def test_optimizer_modules_hold_no_backend_branches(module):
    src = open(os.path.join(PKG, module + ".py")).read()
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            names = {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}
            consts = {n.value for n in ast.walk(node) if isinstance(n, ast.Constant)}
            assert not ("backend" in names or consts & {"torch", "triton", "cpp"}), \
                f"{module}.py:{node.lineno} branches on the backend"
    assert "_engine" not in src


# --------------------------------------------------------------------------- constructors
CLASSES = [getattr(pk, n) for n in pk.__all__]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_unknown_keyword_names_the_closest_valid_one(cls):
    p = [torch.nn.Parameter(torch.zeros(3))]
    kw = {"ess": 10.0} if "ess" in inspect.signature(cls.__init__).parameters else {}
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'lrr'; did you mean 'lr'"):
        cls(p, lr=0.1, lrr=0.1, **kw)
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        cls(p, lr=0.1, bogus=1, **kw)
    cls(p, lr=0.1, **kw)          # the valid call still works


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_constructor_argument_is_documented(cls):
    doc = inspect.getdoc(cls) or ""
    for name in inspect.signature(cls.__init__).parameters:
        if name not in ("self", "params"):
            assert f"``{name}``" in doc, f"{cls.__name__}: argument {name!r} undocumented"


# --------------------------------------------------------------------------- citations
_CITE = re.compile(r"(README|docs/[a-z-]+\.md)[,:]?\s+(?:#\s*)?'([^']+)'")


def _headings(path):
    text = open(os.path.join(ROOT, path)).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {h.strip() for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_citations_of_the_documentation_name_sections_that_exist():
    """An error message or docstring that cites a section of the README or of a file in
    docs/ (the README or the file, a comma, the heading in single quotes) points at a
    heading that exists in that file."""
    found, bad = 0, []
    for top in ("poco_kernels", "benchmarks", "tests"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                if not f.endswith(".py"):
                    continue
                src = open(os.path.join(dirpath, f)).read()
                for doc, section in _CITE.findall(src):
                    found += 1
                    path = "README.md" if doc == "README" else doc
                    if not os.path.exists(os.path.join(ROOT, path)) or \
                            section not in _headings(path):
                        bad.append(f"{f}: {doc}, '{section}'")
    assert found >= 5, "no citations found: the scan is broken"
    assert not bad, bad
