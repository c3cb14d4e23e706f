// Operator calls bound once and made many times: `poco_kernels._C.bind` / `call`.
//
// A step plan (poco_kernels/_step_plan.py) replays the same calls of the operators
// `torch.ops.poco_kernels_cpp.*` with the same arguments at every iteration.  Called from
// Python, an operator parses its arguments against its schema at every call (the step's
// 23: its call took 5.8 us through torch.ops against 1.6 bound, kernel included, at tiny
// tensors on this project's Intel CPU).  `bind` converts them once into the dispatcher's
// values; `call` hands a copy of those to the dispatcher (the same kernel, the same
// dispatch keys, the GIL released as torch's Python calls release it; while a torch
// function mode is active, torch.ops' Python call itself, so that the mode sees it).
#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "py_functions.h"

namespace poco {
namespace {

struct Bound {
  explicit Bound(c10::OperatorHandle h) : op(std::move(h)) {}
  ~Bound() {                                 // (the capsule's destructor: the GIL is held)
    Py_XDECREF(fallback);
    Py_XDECREF(py_args);
  }
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;
  // the Python call, made instead while a torch function mode is active (it sees the
  // operator as it sees torch.ops' calls); nullptr: none given
  PyObject* fallback = nullptr;
  PyObject* py_args = nullptr;
};

constexpr const char* kCapsule = "poco_kernels._C.Bound";

void destroy(PyObject* capsule) {
  delete static_cast<Bound*>(PyCapsule_GetPointer(capsule, kCapsule));
}

}  // namespace

// bind(name, args, fallback=None) -> capsule: poco_kernels_cpp::name (its default
// overload) with `args` (positional, every argument of its schema) converted as a Python
// call converts them; `fallback(*args)` is called instead while a torch function mode is
// active (torch.ops' own overload: the mode sees the call).
PyObject* bind(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  const char* name;
  PyObject* seq;
  PyObject* fallback = Py_None;
  if (!PyArg_ParseTuple(args, "sO|O", &name, &seq, &fallback)) return nullptr;
  auto handle = c10::Dispatcher::singleton().findSchemaOrThrow(
      (std::string("poco_kernels_cpp::") + name).c_str(), "");
  const auto& schema = handle.schema();
  THPObjectPtr items(PySequence_Tuple(seq));
  if (!items) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(items.get());
  if (n != static_cast<Py_ssize_t>(schema.arguments().size())) {
    PyErr_Format(PyExc_TypeError, "bind: %s takes %zd arguments, %zd given", name,
                 static_cast<Py_ssize_t>(schema.arguments().size()), n);
    return nullptr;
  }
  auto bound = std::make_unique<Bound>(handle);
  if (fallback != Py_None) {
    Py_INCREF(fallback);
    bound->fallback = fallback;
    bound->py_args = items.release();
  }
  PyObject* tuple = bound->py_args != nullptr ? bound->py_args : items.get();
  bound->args.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    bound->args.push_back(torch::jit::toIValue(pybind11::handle(PyTuple_GET_ITEM(tuple, i)),
                                               schema.arguments()[i].type()));
  }
  PyObject* capsule = PyCapsule_New(bound.get(), kCapsule, destroy);
  if (capsule == nullptr) return nullptr;
  bound.release();
  return capsule;
  END_HANDLE_TH_ERRORS
}

// call(capsule) -> None: the bound call, made again.
PyObject* call(PyObject* /*self*/, PyObject* capsule) {
  HANDLE_TH_ERRORS
  auto* bound = static_cast<Bound*>(PyCapsule_GetPointer(capsule, kCapsule));
  if (bound == nullptr) return nullptr;
  if (bound->fallback != nullptr && at::impl::torch_function_mode_enabled()) {
    PyObject* out = PyObject_CallObject(bound->fallback, bound->py_args);
    if (out == nullptr) return nullptr;
    Py_DECREF(out);
    Py_RETURN_NONE;
  }
  torch::jit::Stack stack(bound->args);
  {
    pybind11::gil_scoped_release no_gil;
    bound->op.callBoxed(&stack);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace poco
