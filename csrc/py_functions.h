// Functions of the Python module `poco_kernels._C` (its method table: sweeps.cpp) that
// live in other files, and what they share.
#pragma once

#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/python_variable.h>

namespace poco {

// A sequence of tensors.  `Tensors` holds a tuple of its items taken when the call starts
// (a list that Python code run during the call changes cannot free them under us);
// `Tensors(seq, kBorrow)` reads a list or tuple in place (no copy: 148 references taken and
// dropped per call otherwise), for the sweeps that run no Python code while they read: not
// even an allocation of a Python object, which may run the garbage collector and so any
// finalizer (one that empties the list would free the tensors under the sweep).  The engine
// passes lists of its own, which no finalizer reaches; a caller's own list of tensor
// subclasses is still exposed (`THPVariable_Check` of a subclass may run `isinstance`).
enum class Hold { kCopy, kBorrow };

struct Tensors {
  PyObject* fast = nullptr;
  PyObject** items = nullptr;
  Py_ssize_t n = 0;
  explicit Tensors(PyObject* seq, Hold hold = Hold::kCopy) {
    fast = hold == Hold::kCopy ? PySequence_Tuple(seq) : PySequence_Fast(seq, "a sequence expected");
    if (fast != nullptr) {
      n = PySequence_Fast_GET_SIZE(fast);
      items = PySequence_Fast_ITEMS(fast);
    }
  }
  ~Tensors() { Py_XDECREF(fast); }
  Tensors(const Tensors&) = delete;
  Tensors& operator=(const Tensors&) = delete;
  bool ok() const { return fast != nullptr; }
  PyObject* item(Py_ssize_t i) const { return items[i]; }
  // the tensor at i (a TypeError if it is not one: nullptr)
  const at::Tensor* tensor(Py_ssize_t i) const {
    PyObject* o = item(i);
    if (!THPVariable_Check(o)) {
      PyErr_Format(PyExc_TypeError, "item %zd is not a tensor", i);
      return nullptr;
    }
    return &THPVariable_Unpack(o);
  }
};

// `.grad`, as `grad()` gives it, without the warning's checks (see sweeps.cpp)
inline const at::Tensor& grad_of(const at::Tensor& x) { return x.unsafeGetTensorImpl()->grad(); }

// grad_sweeps.cpp: readable_grads(params), set_grads(params, grads), grads_now(params);
// torch.nn.Parameter, set by the module's initialisation
PyObject* readable_grads(PyObject* self, PyObject* arg);
PyObject* set_grads(PyObject* self, PyObject* args);
PyObject* grads_now(PyObject* self, PyObject* arg);
extern PyObject* parameter_type;

// presence.cpp: watch(params, flags, owner) -> None
PyObject* watch(PyObject* self, PyObject* args);

// park.cpp: park(flat, mean, spare, params), unpark(flat, mean, spare, params) -> (before, after)
PyObject* park(PyObject* self, PyObject* args);
PyObject* unpark(PyObject* self, PyObject* args);

// bound.cpp: bind(name, args) -> capsule; call(capsule) -> None
PyObject* bind(PyObject* self, PyObject* args);
PyObject* call(PyObject* self, PyObject* capsule);

// presence.cpp: `p` has the hook `watch` gives it (owner's, setting flags[i]) in place
// (flags: the byte array's storage)
bool watched(const at::Tensor& p, const c10::StorageImpl* flags, int64_t i, int64_t owner);

}  // namespace poco
