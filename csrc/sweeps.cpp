// The Python module `poco_kernels._C`: importing it loads this library, whose other files
// register the operators `torch.ops.poco_kernels_cpp.*` (ops.cpp, presence.cpp).  Its
// functions are the engine's sweeps over a bucket's parameters, which run in every public
// call of an iteration (poco_kernels/_sweeps.py has the Python twin of each, used without
// the extension): a Python sweep over GPT-2's 148 tensors costs 11-17 us on this
// project's CPUs (an attribute read and a comparison per tensor in the interpreter);
// these read the same fields of the C++ tensors, with no Python object made per tensor.
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include "py_functions.h"

#include <cstdint>
#include <string>
#include <type_traits>
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
//   grad_of: `.grad`, as `grad()` gives it, without the warning's checks;
//   trainable_leaf: requires grad and is a leaf (the presence hooks' parameters).
uintptr_t address(const at::Tensor& x) {
  const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
  if (!impl->has_storage() || impl->is_python_dispatch()) {
    return reinterpret_cast<uintptr_t>(x.data_ptr());
  }
  return reinterpret_cast<uintptr_t>(x.const_data_ptr());
}

const at::Tensor& grad_of(const at::Tensor& x) { return x.unsafeGetTensorImpl()->grad(); }

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
  Tensors t(ts, Hold::kBorrow);
  Addresses a;
  if (!t.ok() || !a.init(addrs)) return nullptr;
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
  Tensors t(arg, Hold::kBorrow);
  if (!t.ok()) return nullptr;
  THPObjectPtr out(PyList_New(t.n));         // (freed on every error path)
  if (!out) return nullptr;
  for (Py_ssize_t i = 0; i < t.n; ++i) {
    const at::Tensor* x = t.tensor(i);
    if (x == nullptr) return nullptr;
    PyObject* v = PyLong_FromLongLong(x->_version());
    if (v == nullptr) return nullptr;
    PyList_SET_ITEM(out.get(), i, v);
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

// readable_grads(params) -> (grads, addresses): when every params[i].grad is there, dense
// (strided, with storage), contiguous, of its parameter's dtype and size and without the
// negative bit (readable in place by the kernels), (None, the tuple of their data
// pointers): no Python object is made for the gradients, which are usually new tensors
// after a backward pass; else (each params[i].grad, None where there is none; None).
PyObject* readable_grads(PyObject* /*self*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  Tensors p(arg);
  if (!p.ok()) return nullptr;
  THPObjectPtr addrs(PyTuple_New(p.n));      // (freed on every error path; unset items NULL)
  if (!addrs) return nullptr;
  bool readable = true;
  for (Py_ssize_t i = 0; i < p.n && readable; ++i) {
    const at::Tensor* x = p.tensor(i);
    if (x == nullptr) return nullptr;
    const at::Tensor& g = grad_of(*x);
    readable = g.defined() && g.layout() == at::kStrided && g.has_storage() &&
               g.is_contiguous() && g.scalar_type() == x->scalar_type() &&
               g.numel() == x->numel() && !g.is_neg();
    if (readable) {
      PyObject* a = PyLong_FromVoidPtr(g.data_ptr());          // (as Python's data_ptr)
      if (a == nullptr) return nullptr;
      PyTuple_SET_ITEM(addrs.get(), i, a);
    }
  }
  if (readable) return Py_BuildValue("(ON)", Py_None, addrs.release());
  THPObjectPtr gs(PyList_New(p.n));
  if (!gs) return nullptr;
  for (Py_ssize_t i = 0; i < p.n; ++i) {
    const at::Tensor* x = p.tensor(i);
    if (x == nullptr) return nullptr;
    const at::Tensor& g = grad_of(*x);
    PyObject* w = g.defined() ? THPVariable_Wrap(g) : (Py_INCREF(Py_None), Py_None);
    if (w == nullptr) return nullptr;
    PyList_SET_ITEM(gs.get(), i, w);
  }
  return Py_BuildValue("(NO)", gs.release(), Py_None);
  END_HANDLE_TH_ERRORS
}

// torch.nn.Parameter (set when the module is imported): with torch.Tensor, the types whose
// `.grad` setter is torch's own (no __torch_function__ of a subclass to honour)
PyObject* parameter_type = nullptr;

bool plain(PyObject* o) {
  const auto* t = Py_TYPE(o);
  return t == reinterpret_cast<PyTypeObject*>(THPVariableClass) ||
         (parameter_type != nullptr && t == reinterpret_cast<PyTypeObject*>(parameter_type));
}

// The gradient dtype `var` accepts allows `grad`'s (torch 2.13's `grad_dtype`: the
// tensor's dtype unless set; None: any).  Versions without it check the dtype alone
// (detected in C++17, the standard older torch builds extensions with).
template <class T, class = void>
struct has_grad_dtype : std::false_type {};
template <class T>
struct has_grad_dtype<T, std::void_t<decltype(std::declval<const T&>().grad_dtype())>>
    : std::true_type {};

template <typename T>
bool grad_dtype_allows(const T& var, const at::Tensor& grad) {
  if constexpr (has_grad_dtype<T>::value) {
    const auto gd = var.grad_dtype();
    return !gd.has_value() || *gd == grad.scalar_type();
  } else {
    return true;
  }
}

// set_grads(params, grads) -> None: params[i].grad = grads[i] (grads None: every one None).
// Plain tensors and parameters given a plain tensor that torch's setter accepts (the same
// dtype, device, type and sizes, a grad_dtype that allows it) or None are set here, when
// no torch function mode is active; anything else goes through `setattr`, and so through
// torch's setter, its checks and its errors.
PyObject* set_grads(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *ps, *gs;
  if (!PyArg_ParseTuple(args, "OO", &ps, &gs)) return nullptr;
  Tensors p(ps);
  if (!p.ok()) return nullptr;
  Tensors g(gs == Py_None ? ps : gs);
  if (!g.ok()) return nullptr;
  if (gs != Py_None && g.n != p.n) {
    PyErr_SetString(PyExc_ValueError, "set_grads: as many gradients as parameters expected");
    return nullptr;
  }
  const bool modes = at::impl::torch_function_mode_enabled();
  for (Py_ssize_t i = 0; i < p.n; ++i) {
    PyObject* o = p.item(i);
    PyObject* v = gs == Py_None ? Py_None : g.item(i);
    if (!modes && plain(o)) {
      const at::Tensor& var = THPVariable_Unpack(o);
      if (v == Py_None) {
        var.mutable_grad().reset();
        continue;
      }
      if (v != o && plain(v)) {
        const at::Tensor& grad = THPVariable_Unpack(v);
        // (torch's `options().type_equal`, which computes both dispatch keys: for two
        // strided tensors of one device and dtype those are equal)
        if (grad.layout() == at::kStrided && var.layout() == at::kStrided &&
            grad.scalar_type() == var.scalar_type() && grad.device() == var.device() &&
            grad.sym_sizes().equals(var.sym_sizes()) && grad_dtype_allows(var, grad)) {
          var.mutable_grad() = grad;
          continue;
        }
      }
    }
    if (PyObject_SetAttrString(o, "grad", v) != 0) return nullptr;
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

// grads_now(params) -> list: (params[i], params[i].grad, its version counter or 0 when
// None) for each i, what a `sampled()` block puts back if it fails.  A tensor subclass, or
// any tensor while a torch function mode is active, is read through Python (`.grad`,
// `._version`: whatever its overrides give).
PyObject* grads_now(PyObject* /*self*/, PyObject* arg) {
  HANDLE_TH_ERRORS
  Tensors p(arg);
  if (!p.ok()) return nullptr;
  THPObjectPtr out(PyList_New(p.n));
  if (!out) return nullptr;
  const bool modes = at::impl::torch_function_mode_enabled();
  for (Py_ssize_t i = 0; i < p.n; ++i) {
    const at::Tensor* x = p.tensor(i);
    if (x == nullptr) return nullptr;
    PyObject* item = nullptr;
    if (modes || !plain(p.item(i))) {
      THPObjectPtr g(PyObject_GetAttrString(p.item(i), "grad"));
      if (!g) return nullptr;
      THPObjectPtr v(g.get() == Py_None ? PyLong_FromLong(0)
                                        : PyObject_GetAttrString(g.get(), "_version"));
      if (!v) return nullptr;
      item = PyTuple_Pack(3, p.item(i), g.get(), v.get());
      if (item == nullptr) return nullptr;
      PyList_SET_ITEM(out.get(), i, item);
      continue;
    }
    const at::Tensor& g = grad_of(*x);
    item = PyTuple_New(3);      // (filled in place: no format string parsed per parameter)
    if (item == nullptr) return nullptr;
    PyList_SET_ITEM(out.get(), i, item);
    Py_INCREF(p.item(i));
    PyTuple_SET_ITEM(item, 0, p.item(i));
    PyObject* w = g.defined() ? THPVariable_Wrap(g) : Py_NewRef(Py_None);
    if (w == nullptr) return nullptr;
    PyTuple_SET_ITEM(item, 1, w);
    PyObject* v = PyLong_FromLongLong(g.defined() ? static_cast<long long>(g._version()) : 0);
    if (v == nullptr) return nullptr;
    PyTuple_SET_ITEM(item, 2, v);
  }
  return out.release();
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
  Tensors p(ps, Hold::kBorrow);     // (no Python code runs while the sweep reads)
  if (!p.ok()) return nullptr;
  Tensors v(vs == Py_None ? ps : vs, Hold::kBorrow);
  if (!v.ok()) return nullptr;
  Addresses addrs;
  if (as != Py_None && !addrs.init(as)) return nullptr;
  const bool want_versions = cs != Py_False;
  if (!want_versions) cs = Py_None;
  THPObjectPtr clean(cs == Py_None ? nullptr : PySequence_Fast(cs, "scan: a sequence of versions expected"));
  if (cs != Py_None && !clean) return nullptr;
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
