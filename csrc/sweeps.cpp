// The Python module `poco_kernels._C`: importing it loads this library, whose other files
// register the operators `torch.ops.poco_kernels_cpp.*` (ops.cpp, presence.cpp).  Its
// functions are the engine's sweeps over a bucket's parameters (those that set or hand
// back `.grad`, and may run Python code: grad_sweeps.cpp), which run in every public
// call of an iteration (poco_kernels/_sweeps.py has the Python twin of each, used without
// the extension): a Python sweep over GPT-2's 148 tensors costs 11-17 us on this
// project's CPUs (an attribute read and a comparison per tensor in the interpreter);
// these read the same fields of the C++ tensors, with no Python object made per tensor.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include "py_functions.h"

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace poco {
namespace {

// What the sweeps read of each tensor, by the shortest way (at 148 tensors the at::Tensor
// accessors' checks were most of a sweep: `grad()` asks whether the tensor is a leaf and
// retains its gradient, through two virtual calls, to warn about a non-leaf's `.grad`;
// `data_ptr()` checks for a copy-on-write storage to materialise).
//   address: the first element's address, as `data_ptr()` gives it (no storage: the
//     accessor itself, which raises as Python's `data_ptr()` does);
//   grad_of (py_functions.h): `.grad`, as `grad()` gives it, without the warning's checks;
//   trainable_leaf: requires grad and is a leaf (the presence hooks' parameters).
uintptr_t address(const at::Tensor& x) {
  const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->is_python_dispatch()) {
    return reinterpret_cast<uintptr_t>(x.data_ptr());
  }
  return reinterpret_cast<uintptr_t>(x.const_data_ptr());
}

bool trainable_leaf(const at::Tensor& x) {
  auto* meta = torch::autograd::impl::get_autograd_meta(x);
  if (meta == nullptr || !meta->requires_grad()) return false;
  if (meta->is_view_) return x.is_leaf();     // (a view's grad_fn may be made on demand)
  return meta->grad_fn_ == nullptr;
}

// A sequence of addresses: a buffer of uint64 (array('Q'): read in place, the engine's
// form) or any sequence of ints (each converted).
struct Addresses {
  Py_buffer buf{};
  bool held = false;
  THPObjectPtr items;
  Py_ssize_t n = 0;
  bool init(PyObject* o) {
    if (PyObject_CheckBuffer(o)) {
      if (PyObject_GetBuffer(o, &buf, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return false;
      held = true;
      if (buf.itemsize != 8 || buf.format == nullptr ||
          (std::string(buf.format) != "Q" && std::string(buf.format) != "L")) {
        PyErr_SetString(PyExc_TypeError, "addresses: a buffer of uint64 expected");
        return false;
      }
      n = buf.len / 8;
      return true;
    }
    items = PySequence_Tuple(o);
    if (!items) return false;
    n = PyTuple_GET_SIZE(items.get());
    return true;
  }
  // the i-th address (an error set, and 0, if it is not an unsigned int)
  unsigned long long at(Py_ssize_t i) const {
    if (held) return static_cast<const unsigned long long*>(buf.buf)[i];
    return PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(items.get(), i));
  }
  ~Addresses() {
    if (held) PyBuffer_Release(&buf);
  }
};

// same_addresses(tensors, addresses) -> bool: tensors[i].data_ptr() == addresses[i] for
// every i (and as many of each).
PyObject* same_addresses(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *ts, *addrs;
  if (!PyArg_ParseTuple(args, "OO", &ts, &addrs)) return nullptr;
  Addresses a;                               // (first: it may allocate, see `Tensors`)
  if (!a.init(addrs)) return nullptr;
  Tensors t(ts, Hold::kBorrow);
  if (!t.ok()) return nullptr;
  if (t.n != a.n) Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < t.n; ++i) {
    const at::Tensor* x = t.tensor(i);
    if (x == nullptr) return nullptr;
    const unsigned long long want = a.at(i);
    if (PyErr_Occurred()) return nullptr;
    if (address(*x) != want) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
  END_HANDLE_TH_ERRORS
}

// versions(tensors) -> list: each tensor's version counter (``t._version``).
PyObject* versions(PyObject* /*self*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  std::vector<long long> seen;
  {
    Tensors t(arg, Hold::kBorrow);            // (read before any Python object is made)
    if (!t.ok()) return nullptr;
    seen.reserve(static_cast<size_t>(t.n));
    for (Py_ssize_t i = 0; i < t.n; ++i) {
      const at::Tensor* x = t.tensor(i);
      if (x == nullptr) return nullptr;
      seen.push_back(static_cast<long long>(x->_version()));
    }
  }
  THPObjectPtr out(PyList_New(static_cast<Py_ssize_t>(seen.size())));  // (freed on errors)
  if (!out) return nullptr;
  for (size_t i = 0; i < seen.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(seen[i]);
    if (v == nullptr) return nullptr;
    PyList_SET_ITEM(out.get(), static_cast<Py_ssize_t>(i), v);
  }
  return out.release();
  END_HANDLE_TH_ERRORS
}

// grads(params, views) -> (defined, matching): how many params[i].grad are not None, and
// how many are views[i] itself (views None: 0).
PyObject* grads(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *ps, *vs;
  if (!PyArg_ParseTuple(args, "OO", &ps, &vs)) return nullptr;
  Tensors p(ps, Hold::kBorrow);
  if (!p.ok()) return nullptr;
  Tensors v(vs == Py_None ? ps : vs, Hold::kBorrow);        // (unused when None)
  if (!v.ok()) return nullptr;
  if (vs != Py_None && v.n != p.n) {
    PyErr_SetString(PyExc_ValueError, "grads: as many views as parameters expected");
    return nullptr;
  }
  Py_ssize_t defined = 0, matching = 0;
  for (Py_ssize_t i = 0; i < p.n; ++i) {
    const at::Tensor* x = p.tensor(i);
    if (x == nullptr) return nullptr;
    const at::Tensor& g = grad_of(*x);
    if (!g.defined()) continue;
    ++defined;
    if (vs != Py_None) {
      const at::Tensor* w = v.tensor(i);
      if (w == nullptr) return nullptr;
      if (g.unsafeGetTensorImpl() == w->unsafeGetTensorImpl()) ++matching;
    }
  }
  return Py_BuildValue("(nn)", defined, matching);
  END_HANDLE_TH_ERRORS
}

// trainable(tensors) -> int: how many require grad.
PyObject* trainable(PyObject* /*self*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  Tensors t(arg, Hold::kBorrow);
  if (!t.ok()) return nullptr;
  Py_ssize_t n = 0;
  for (Py_ssize_t i = 0; i < t.n; ++i) {
    const at::Tensor* x = t.tensor(i);
    if (x == nullptr) return nullptr;
    n += x->requires_grad() ? 1 : 0;
  }
  return PyLong_FromSsize_t(n);
  END_HANDLE_TH_ERRORS
}

// scan(params, addresses, views, clean, flags, owner) -> (flat, defined, matching, clean,
// watched): what the engine checks of a bucket's parameters at each call of an iteration,
// in one pass (each parameter's objects read once; the separate sweeps read them four
// times):
//   flat: params[i].data_ptr() == addresses[i] for every i (addresses None: True);
//   defined, matching: grads(params, views);
//   clean: views and clean given, True if every views[i]._version == clean[i]; else, views
//     given, the list of their versions (what `versions(views)` gives: a buffer zeroed now
//     is clean at those, its views' counters being their own); else False (and when clean
//     is False: the versions are not wanted, no list is made);
//   watched: flags a tensor, every params[i] that requires grad and is a leaf has the hook
//     of `owner` that sets flags[i] (`watch` would change nothing); flags None: False.
PyObject* scan(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *ps, *as, *vs, *cs, *fo;
  long long owner;
  if (!PyArg_ParseTuple(args, "OOOOOL", &ps, &as, &vs, &cs, &fo, &owner)) return nullptr;
  Addresses addrs;                  // (these two first: they may allocate, see `Tensors`)
  if (as != Py_None && !addrs.init(as)) return nullptr;
  const bool want_versions = cs != Py_False;
  if (!want_versions) cs = Py_None;
  THPObjectPtr clean(cs == Py_None ? nullptr : PySequence_Fast(cs, "scan: a sequence of versions expected"));
  if (cs != Py_None && !clean) return nullptr;
  Tensors p(ps, Hold::kBorrow);     // (no Python code runs while the sweep reads)
  if (!p.ok()) return nullptr;
  Tensors v(vs == Py_None ? ps : vs, Hold::kBorrow);
  if (!v.ok()) return nullptr;
  if ((vs != Py_None && v.n != p.n) || (cs != Py_None && vs != Py_None &&
                                        PySequence_Fast_GET_SIZE(clean.get()) != v.n)) {
    PyErr_SetString(PyExc_ValueError, "scan: as many views and versions as parameters expected");
    return nullptr;
  }
  const at::Tensor* flags = nullptr;
  if (fo != Py_None) {
    if (!THPVariable_Check(fo)) {
      PyErr_SetString(PyExc_TypeError, "scan: flags must be a tensor or None");
      return nullptr;
    }
    flags = &THPVariable_Unpack(fo);
  }
  const c10::StorageImpl* flags_storage =
      flags != nullptr ? flags->unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl()
                       : nullptr;
  bool flat = as != Py_None ? addrs.n == p.n : true;
  bool is_clean = vs != Py_None && cs != Py_None;
  // the views' versions, kept until they are known not to be needed
  std::vector<long long> seen;
  const bool versions = vs != Py_None && want_versions;
  if (versions) seen.reserve(static_cast<size_t>(v.n));
  bool hooked = flags != nullptr;
  Py_ssize_t defined = 0, matching = 0;
  for (Py_ssize_t i = 0; i < p.n; ++i) {
    const at::Tensor* x = p.tensor(i);
    if (x == nullptr) return nullptr;
    if (flat && as != Py_None) {
      const unsigned long long want = addrs.at(i);
      if (PyErr_Occurred()) return nullptr;
      flat = address(*x) == want;
    }
    const at::Tensor& g = grad_of(*x);
    const at::Tensor* w = nullptr;
    if (vs != Py_None) {
      w = v.tensor(i);
      if (w == nullptr) return nullptr;
    }
    if (g.defined()) {
      ++defined;
      if (w != nullptr && g.unsafeGetTensorImpl() == w->unsafeGetTensorImpl()) ++matching;
    }
    if (w != nullptr && versions) {
      const auto version = static_cast<long long>(w->_version());
      seen.push_back(version);
      if (is_clean) {
        const long long want = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(clean.get(), i));
        if (PyErr_Occurred()) return nullptr;
        is_clean = version == want;
      }
    }
    if (hooked && trainable_leaf(*x)) {
      hooked = watched(*x, flags_storage, static_cast<int64_t>(i), owner);
    }
  }
  PyObject* clean_out = is_clean ? Py_True : Py_False;
  THPObjectPtr versions_out;
  if (!is_clean && versions) {
    versions_out = PyList_New(v.n);
    if (!versions_out) return nullptr;
    for (Py_ssize_t i = 0; i < v.n; ++i) {
      PyObject* o = PyLong_FromLongLong(seen[static_cast<size_t>(i)]);
      if (o == nullptr) return nullptr;
      PyList_SET_ITEM(versions_out.get(), i, o);
    }
    clean_out = versions_out.get();
  }
  return Py_BuildValue("(OnnOO)", flat ? Py_True : Py_False, defined, matching, clean_out,
                       hooked ? Py_True : Py_False);
  END_HANDLE_TH_ERRORS
}

PyMethodDef kMethods[] = {
    {"scan", scan, METH_VARARGS,
     "scan(params, addresses, views, clean, flags, owner) -> (flat, defined, matching, "
     "clean, watched): same_addresses, grads, the views' versions against clean, and the "
     "presence hooks in place, in one pass"},
    {"same_addresses", same_addresses, METH_VARARGS,
     "same_addresses(tensors, addresses) -> bool: every tensors[i].data_ptr() == addresses[i]"},
    {"versions", versions, METH_O, "versions(tensors) -> list: each tensor's _version"},
    {"park", park, METH_VARARGS,
     "park(flat, mean, spare, params) -> (before, after): flat's storage reads mean's memory, "
     "its own waits in the empty spare; params' versions bumped; their sums before, after"},
    {"unpark", unpark, METH_VARARGS,
     "unpark(flat, mean, spare, params) -> (before, after) or None: flat's storage takes its "
     "memory back from the spare; params' versions bumped; their sums before and after "
     "(None: it was given other memory while parked, and keeps it)"},
    {"grads", grads, METH_VARARGS,
     "grads(params, views) -> (defined, matching): .grad not None, .grad is views[i]"},
    {"readable_grads", readable_grads, METH_O,
     "readable_grads(params) -> (grads, addresses): (None, their data pointers) when every "
     ".grad is dense, contiguous, of its parameter's dtype and size, not negated; else "
     "(the .grad, None)"},
    {"set_grads", set_grads, METH_VARARGS,
     "set_grads(params, grads) -> None: params[i].grad = grads[i] (grads None: None)"},
    {"trainable", trainable, METH_O, "trainable(tensors) -> int: how many require grad"},
    {"grads_now", grads_now, METH_O,
     "grads_now(params) -> list: (param, param.grad, its _version or 0 when None) each"},
    {"bind", bind, METH_VARARGS,
     "bind(name, args) -> capsule: the operator poco_kernels_cpp::name with its arguments "
     "converted once (bound.cpp)"},
    {"call", call, METH_O, "call(capsule) -> None: a bound operator call, made again"},
    {"watch", watch, METH_VARARGS,
     "watch(params, flags, owner) -> None: a hook on each parameter that requires grad "
     "that sets flags[i] when autograd accumulates into it (presence.cpp)"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_C",
                       "poco_kernels' C++ extension: the CPU kernels "
                       "(torch.ops.poco_kernels_cpp.*) and the engine's sweeps over parameters",
                       -1, kMethods};

}  // namespace
}  // namespace poco

PyMODINIT_FUNC PyInit__C(void) {
  PyObject* nn = PyImport_ImportModule("torch.nn.parameter");
  if (nn == nullptr) return nullptr;
  poco::parameter_type = PyObject_GetAttrString(nn, "Parameter");     // (kept: a strong ref)
  Py_DECREF(nn);
  if (poco::parameter_type == nullptr) return nullptr;
  return PyModule_Create(&poco::kModule);
}
