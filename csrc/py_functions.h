// Functions of the Python module `poco_kernels._C` (its method table: sweeps.cpp) that
// live in other files.
#pragma once

#include <Python.h>

namespace poco {

// presence.cpp: watch(params, flags, owner) -> None
PyObject* watch(PyObject* self, PyObject* args);

}  // namespace poco
