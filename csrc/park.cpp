// `poco_kernels._C.park` / `unpark` (their entries: the method table of sweeps.cpp).
// Parking (poco_kernels/backends/fused_park.py): between public calls the parameters'
// storage reads the mean buffer's memory, and its own memory (the next sample) waits in a
// spare storage; nothing is copied.  The memory is held by reference-counted blocks
// (below): the parameters' storage keeps the mean's memory and its own alive, so it stays
// valid whatever is freed, resized or moved first.
#include <Python.h>

#include <ATen/ATen.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include "py_functions.h"

#include <atomic>
#include <memory>
#include <vector>

namespace poco {
namespace {

// Each memory block parking hands around (the flat buffer's own allocation, the mean
// buffer's) is held by reference count: the storages that read it and the ones that only
// keep it alive each hold one reference, so a block lives while any of them does, whatever
// is freed or given other memory first (the optimizer dropped while parked, the mean's
// storage resized or moved to shared memory while the parameters read it, a numpy array
// taken of a parameter before it was parked).
struct Block {
  c10::DataPtr own;               // the allocator's DataPtr: freed with the last reference
  std::atomic<long> refs{0};
};
void drop_ref(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  if (b->refs.fetch_sub(1) == 1) delete b;
}
c10::DataPtr ref(Block* b, c10::Device device) {
  b->refs.fetch_add(1);
  return c10::DataPtr(b->own.get(), b, &drop_ref, device);
}

// A storage's memory with other blocks kept alive: refs[0] is the block it reads, the rest
// (references too) live as long as it does.  Parked, the flat buffer's storage reads the
// mean's block (`drop_alias`) and keeps its own; unparked after a park it reads its own
// block (`drop_owned`) and keeps every mean it read while parked, so a raw pointer taken
// while parked stays valid as long as the storage lives.
struct Holder {
  std::vector<c10::DataPtr> refs;
};
void drop_alias(void* ctx) { delete static_cast<Holder*>(ctx); }
void drop_owned(void* ctx) { delete static_cast<Holder*>(ctx); }

Block* block_in(const c10::DataPtr& d) {       // (the block a reference reads, else null)
  return d.get_deleter() == &drop_ref ? static_cast<Block*>(d.get_context()) : nullptr;
}

// A storage's memory is parking's own (a block reference or a Holder) or the device
// allocator's plain allocation (which parking may turn into a block).  Any other memory
// (shared memory, a file mapping, another library's) is not parked: wrapping it would hide
// what it is from torch (`is_shared()`, a second `share_memory_()` that then moves it).
bool parkable(const c10::StorageImpl* s) {
  const c10::DataPtr& d = s->data_ptr();
  if (d.get_deleter() == &drop_ref || d.get_deleter() == &drop_alias ||
      d.get_deleter() == &drop_owned) {
    return true;
  }
  const c10::Allocator* a = c10::GetAllocator(s->device().type());
  return a != nullptr && a->raw_deleter() != nullptr && d.get_deleter() == a->raw_deleter();
}

// The blocks a (parkable) storage's DataPtr reads or keeps, the one it reads first; the
// allocator's DataPtr becomes a reference to a new block first.
std::vector<Block*> blocks_of(c10::StorageImpl* s) {
  const c10::DataPtr& d = s->data_ptr();
  if (d.get_deleter() == &drop_alias || d.get_deleter() == &drop_owned) {
    std::vector<Block*> out;
    for (const auto& r : static_cast<Holder*>(d.get_context())->refs) out.push_back(block_in(r));
    return out;
  }
  if (Block* b = block_in(d)) return {b};
  auto* b = new Block{s->set_data_ptr(c10::DataPtr(nullptr, s->device()))};
  s->set_data_ptr_noswap(ref(b, s->device()));
  return {b};
}

// A Holder's DataPtr reading `reads`, keeping `keep` (each block once) but `drop`.
c10::DataPtr holding(Block* reads, const std::vector<Block*>& keep, c10::DeleterFnPtr deleter,
                     c10::Device device, const Block* drop = nullptr) {
  auto* h = new Holder;
  h->refs.push_back(ref(reads, device));
  for (Block* b : keep) {
    bool held = b == drop;
    for (const auto& r : h->refs) held = held || block_in(r) == b;
    if (!held) h->refs.push_back(ref(b, device));
  }
  return c10::DataPtr(reads->own.get(), h, deleter, device);
}

// A byte tensor over the first n bytes of storage s (made and copied into with Python's
// dispatch keys excluded, so that no Python code runs inside park/unpark).
at::Tensor bytes_of(c10::StorageImpl* s, size_t n) {
  c10::Storage st(c10::intrusive_ptr<c10::StorageImpl>::reclaim_copy(s));
  return at::empty({0}, at::TensorOptions().dtype(at::kByte).device(s->device()))
      .set_(st, 0, {static_cast<int64_t>(n)}, {1});
}

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

// park(flat, mean, spare, params) -> (before, after), or None: the flat buffer's storage
// reads the mean's memory, keeping its own alive, which the (empty) spare takes; each of
// params has its version bumped (a backward through a graph that saved one before fails,
// as after an in-place write).  before/after: the sums of their versions (counters only
// grow: equal sums, none moved).  None, with nothing changed: a memory is not parkable.
PyObject* park(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  Parked k;
  if (!k.init(args)) return nullptr;
  const Tensors& p = *k.params;
  TORCH_CHECK(k.spare->nbytes() == 0, "park: the spare is not empty (parked already?)");
  TORCH_CHECK(k.flat->nbytes() == k.mean->nbytes(), "park: the flat buffer has ",
              k.flat->nbytes(), " bytes, the mean ", k.mean->nbytes());
  TORCH_CHECK(k.flat->data_ptr().get_deleter() != &drop_alias, "park: parked already");
  if (!parkable(k.flat) || !parkable(k.mean)) Py_RETURN_NONE;
  const long long before = version_sum(p);
  const long long after = bump(p);             // (first: a refused bump changes no memory)
  const c10::Device device = k.flat->device();
  const size_t nbytes = k.flat->nbytes();
  k.flat->mutable_data();                      // (a copy-on-write storage materialised:
  k.mean->mutable_data();                      //  the memory is written from now on)
  std::vector<Block*> own = blocks_of(k.flat);   // (its own block first, then means it keeps)
  Block* mean = blocks_of(k.mean).front();
  k.spare->set_data_ptr_noswap(ref(own.front(), device));
  k.spare->set_nbytes(nbytes);
  k.flat->set_data_ptr_noswap(holding(mean, own, &drop_alias, device));
  return Py_BuildValue("(LL)", before, after);
  END_HANDLE_TH_ERRORS
}

// unpark(flat, mean, spare, params) -> (before, after), or None: the flat buffer's storage
// reads its own memory again (the spare left empty), keeping every mean it read; the
// versions as for park.  A mean buffer given other memory while parked (its storage
// resized, moved to shared memory) first takes what the parameters read.  None, with
// nothing changed but the spare emptied: the flat storage was given other memory while
// parked (`share_memory_()`, a resize), which now holds the mean (the sample is dropped).
PyObject* unpark(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  Parked k;
  if (!k.init(args)) return nullptr;
  const Tensors& p = *k.params;
  const c10::Device device = k.spare->device();
  if (k.flat->data_ptr().get_deleter() != &drop_alias || k.spare->nbytes() != k.flat->nbytes() ||
      block_in(k.spare->data_ptr()) == nullptr) {
    k.spare->set_data_ptr_noswap(c10::DataPtr(nullptr, device));
    k.spare->set_nbytes(0);
    Py_RETURN_NONE;
  }
  const size_t nbytes = k.spare->nbytes();
  const bool moved = k.mean->data_ptr().get() != k.flat->data_ptr().get();
  TORCH_CHECK(!moved || k.mean->nbytes() == nbytes, "unpark: the mean buffer's storage was "
              "resized to ", k.mean->nbytes(), " bytes while the parameters read it (", nbytes,
              "): the optimizer's state is no longer usable");
  const long long before = version_sum(p);
  const long long after = bump(p);               // (the last read of params: see bytes_of)
  std::vector<Block*> keep = blocks_of(k.flat);   // (the mean read, then its own and others)
  if (moved) {                                    // (the mean takes what the parameters read)
    c10::impl::ExcludeDispatchKeyGuard no_python(
        c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
    bytes_of(k.mean, nbytes).copy_(bytes_of(k.flat, nbytes));
  }
  Block* own = block_in(k.spare->data_ptr());
  // (a mean moved away is not kept: a raw pointer taken into it while parked is left as torch
  //  leaves any pointer into memory that a resize or `share_memory_()` moved)
  k.flat->set_data_ptr_noswap(
      holding(own, keep, &drop_owned, device, moved ? keep.front() : nullptr));
  k.spare->set_data_ptr_noswap(c10::DataPtr(nullptr, device));
  k.spare->set_nbytes(0);
  k.flat->set_nbytes(nbytes);
  return Py_BuildValue("(LL)", before, after);
  END_HANDLE_TH_ERRORS
}

}  // namespace poco
