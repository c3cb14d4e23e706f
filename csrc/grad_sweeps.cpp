// The sweeps that set or hand back `.grad` (`poco_kernels._C`'s `readable_grads`,
// `set_grads`, `grads_now`; the method table is in sweeps.cpp).  Unlike the reading sweeps
// they may run Python code in their loop (a subclass's setter, a torch function mode), so
// they hold a copy of the list they are given (`Tensors` with `Hold::kCopy`).
#include <Python.h>

#include <ATen/ATen.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/object_ptr.h>

#include "py_functions.h"

#include <type_traits>
#include <utility>

namespace poco {

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

namespace {

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

}  // namespace

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

}  // namespace poco
