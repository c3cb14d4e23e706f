// `poco_kernels._C.park` / `unpark` (their entries: the method table of sweeps.cpp).
// Parking (poco_kernels/backends/fused_park.py): between public calls the parameters'
// storage reads the mean buffer's memory, and its own memory (the next sample) waits in a
// spare storage; nothing is copied.  The alias holds a reference to the mean's storage,
// so the parameters keep their memory valid whatever is freed first.
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include "py_functions.h"

#include <memory>
#include <vector>

namespace poco {
namespace {

void drop_alias(void* ctx) { delete static_cast<c10::Storage*>(ctx); }

// The flat buffer's own memory once it has been parked: the allocation, and a reference to
// the mean's storage.  A raw pointer taken while parked (numpy, DLPack, `data_ptr()`) is
// the mean's memory, so it lives as long as the flat storage does, whatever is freed first.
struct Owned {
  c10::DataPtr own;
  std::vector<c10::Storage> means;   // (one per mean buffer it was parked on: a new layout's)
};
void drop_owned(void* ctx) { delete static_cast<Owned*>(ctx); }

// A sequence of tensors only (else an error set: false).
bool all_tensors(const Tensors& p) {
  if (!p.ok()) return false;
  for (Py_ssize_t i = 0; i < p.n; ++i) {
    if (p.tensor(i) == nullptr) return false;
  }
  return true;
}

// The arguments of park and unpark, (flat, mean, spare, params), checked: the storages of
// the flat parameter buffer, the mean buffer and the spare, and the parameters.
struct Parked {
  c10::StorageImpl *flat = nullptr, *mean = nullptr, *spare = nullptr;
  std::unique_ptr<Tensors> params;
  bool init(PyObject* args) {
    PyObject *fo, *mo, *so, *ps;
    if (!PyArg_ParseTuple(args, "OOOO", &fo, &mo, &so, &ps)) return false;
    if (!THPVariable_Check(fo) || !THPVariable_Check(mo) || !THPVariable_Check(so)) {
      PyErr_SetString(PyExc_TypeError, "park/unpark: tensors expected");
      return false;
    }
    const at::Tensor& f = THPVariable_Unpack(fo);
    const at::Tensor& m = THPVariable_Unpack(mo);
    const at::Tensor& s = THPVariable_Unpack(so);
    bool plain = true;
    for (const at::Tensor* t : {&f, &m, &s}) {
      plain = plain && t->has_storage() && !t->unsafeGetTensorImpl()->is_python_dispatch() &&
              t->device() == f.device();
    }
    TORCH_CHECK(plain, "park/unpark: plain tensors with storage on one device expected");
    flat = f.storage().unsafeGetStorageImpl();
    mean = m.storage().unsafeGetStorageImpl();
    spare = s.storage().unsafeGetStorageImpl();
    TORCH_CHECK(flat != spare && mean != flat && mean != spare,
                "park/unpark: the flat buffer, the mean and the spare share a storage");
    params = std::make_unique<Tensors>(ps, Hold::kBorrow);
    return all_tensors(*params);
  }
};

long long version_sum(const Tensors& p) {
  long long sum = 0;
  for (Py_ssize_t i = 0; i < p.n; ++i) sum += p.tensor(i)->_version();
  return sum;
}

long long bump(const Tensors& p) {
  for (Py_ssize_t i = 0; i < p.n; ++i) torch::autograd::impl::bump_version(*p.tensor(i));
  return version_sum(p);
}

}  // namespace

// park(flat, mean, spare, params) -> (before, after): the flat buffer's storage hands its
// memory to the (empty) spare and reads the mean's; each of params has its version bumped
// (a backward through a graph that saved one before fails, as after an in-place write).
// before/after: the sums of their versions (counters only grow: equal sums, none moved).
PyObject* park(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  Parked k;
  if (!k.init(args)) return nullptr;
  const Tensors& p = *k.params;
  TORCH_CHECK(k.spare->nbytes() == 0, "park: the spare is not empty (parked already?)");
  TORCH_CHECK(k.flat->nbytes() == k.mean->nbytes(), "park: the flat buffer has ",
              k.flat->nbytes(), " bytes, the mean ", k.mean->nbytes());
  TORCH_CHECK(k.flat->data_ptr().get_deleter() != &drop_alias, "park: parked already");
  const long long before = version_sum(p);
  const size_t nbytes = k.flat->nbytes();     // (the spare now owns the sample's memory;
  k.spare->set_data_ptr_noswap(               //  set_data_ptr, not swap_data_ptr: torch 2.11)
      k.flat->set_data_ptr(c10::DataPtr(nullptr, k.flat->device())));
  k.spare->set_nbytes(nbytes);
  auto* ref = new c10::Storage(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(k.mean));
  k.flat->set_data_ptr_noswap(
      c10::DataPtr(k.mean->mutable_data(), ref, &drop_alias, k.mean->device()));
  k.flat->set_nbytes(k.mean->nbytes());
  const long long after = bump(p);
  return Py_BuildValue("(LL)", before, after);
  END_HANDLE_TH_ERRORS
}

// unpark(flat, mean, spare, params) -> (before, after), or None: the flat buffer's storage
// takes its own memory back from the spare (left empty), holding a reference to the mean's
// storage from now on; the versions as for park.  None, with nothing changed but the spare
// emptied: the storage was given other memory while parked (`share_memory_()`, a resize),
// which now holds the mean (the sample is dropped).
PyObject* unpark(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  Parked k;
  if (!k.init(args)) return nullptr;
  const Tensors& p = *k.params;
  if (k.flat->data_ptr().get_deleter() != &drop_alias || k.spare->nbytes() != k.flat->nbytes()) {
    k.spare->set_data_ptr_noswap(c10::DataPtr(nullptr, k.spare->device()));
    k.spare->set_nbytes(0);
    Py_RETURN_NONE;
  }
  const long long before = version_sum(p);
  const size_t nbytes = k.spare->nbytes();
  c10::DataPtr own = k.spare->set_data_ptr(c10::DataPtr(nullptr, k.spare->device()));
  k.spare->set_nbytes(0);
  if (own.get_deleter() != &drop_owned) {    // (the first unpark: the allocator's own)
    void* data = own.get();
    const c10::Device device = own.device();
    own = c10::DataPtr(data, new Owned{std::move(own), {}}, &drop_owned, device);
  }
  auto& means = static_cast<Owned*>(own.get_context())->means;
  bool held = false;
  for (const auto& m : means) held = held || m.unsafeGetStorageImpl() == k.mean;
  if (!held) means.emplace_back(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(k.mean));
  k.flat->set_data_ptr_noswap(std::move(own));     // (the alias dropped)
  k.flat->set_nbytes(nbytes);
  const long long after = bump(p);
  return Py_BuildValue("(LL)", before, after);
  END_HANDLE_TH_ERRORS
}

}  // namespace poco
