// Which parameters autograd reached: `poco_kernels._C.watch`.
//
// The fused engine hands every trainable parameter a `.grad` that is a view of a zeroed
// flat buffer, so a parameter autograd never reached still has a (zero) `.grad`; it must
// be left out of the step, as torch.optim leaves out a `.grad` of None.  A hook on each
// parameter says which ones a backward reached: one byte per parameter of a bucket, set
// to 1 once autograd has accumulated a gradient into it, cleared by the engine when it
// hands the views out (poco_kernels/backends/fused_presence.py).
//
// A Python hook costs the backward about 0.7-2.3 us per parameter (the engine takes the
// GIL, wraps the tensor, calls the function); this one is a store.  It sits in the
// tensor's post-accumulate-grad slot (autograd keeps one hook object there; Python's
// `register_post_accumulate_grad_hook` puts its dict of hooks in it), keeps the object it
// found there and runs it after setting its byte, so the user's hooks still run.  It holds
// its byte array weakly: once the engine is gone it only runs the hook it wraps.  Hooks
// are re-used, not stacked: `watch` re-points the hook of the same owner (a new layout of
// the same optimizer), else one whose array is gone, and does nothing to a hook already
// in place (the engine calls it before every backward).
//
// Where it does not run the byte stays 0 and the engine reads whether the view holds
// zeros instead (so a gradient that is exactly zero everywhere counts as none there):
// under compiled autograd, which is given only the wrapped hooks to trace (the engine
// installs Python hooks instead when `torch._dynamo.config.compiled_autograd` is set at
// the hand-out); and, until the next hand-out, in the backward passes after a
// parameter's first Python post-accumulate-grad hook was registered between a hand-out
// and them (torch's registration replaces the slot's object; the next `watch` wraps it).
#include <Python.h>

#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <memory>
#include <typeinfo>

#include "py_functions.h"

namespace poco {
namespace {

using Hook = torch::autograd::PostAccumulateGradHook;

struct PresenceHook final : Hook {
  c10::weak_intrusive_ptr<c10::StorageImpl> flags;
  int64_t index;
  int64_t owner;
  std::unique_ptr<Hook> inner;  // the object the slot held before (the user's hooks)

  PresenceHook(const at::Tensor& f, int64_t i, int64_t o, std::unique_ptr<Hook> in)
      : flags(f.storage().getWeakStorageImpl()), index(i), owner(o), inner(std::move(in)) {}

  void operator()(const torch::autograd::Variable& tensor) override {
    // the byte first: the wrapped hooks may replace the slot's object, this one with it
    if (auto s = flags.lock()) {
      static_cast<uint8_t*>(s->mutable_data())[index] = 1;
    }
    if (inner) (*inner)(tensor);
  }

  // Compiled autograd traces the wrapped hooks only (the byte stays 0: the engine reads).
  void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
    if (inner) inner->compiled_args(args);
  }
  void apply_with_saved(torch::autograd::Variable& tensor,
                        torch::dynamo::autograd::SwapSavedVariables& saved) override {
    if (inner) inner->apply_with_saved(tensor, saved);
  }
};

// `h` as a presence hook, or nullptr (a type comparison: no dynamic_cast per parameter)
PresenceHook* as_ours(Hook* h) {
  return h != nullptr && typeid(*h) == typeid(PresenceHook) ? static_cast<PresenceHook*>(h)
                                                            : nullptr;
}

}  // namespace

bool watched(const at::Tensor& p, const c10::StorageImpl* flags, int64_t i, int64_t owner) {
  for (PresenceHook* ours = as_ours(torch::autograd::impl::post_acc_grad_hooks(p).get());
       ours != nullptr; ours = as_ours(ours->inner.get())) {
    if (ours->owner == owner) {
      return ours->index == i && ours->flags._unsafe_get_target() == flags;
    }
  }
  return false;
}

namespace {

// Give `p` a hook that sets flags[i] (owner: the engine's token); a no-op if it has one.
void watch_one(const at::Tensor& p, const at::Tensor& flags, int64_t i, int64_t owner) {
  std::unique_ptr<Hook>& slot = torch::autograd::impl::post_acc_grad_hooks(p);
  PresenceHook* mine = nullptr;
  PresenceHook* dead = nullptr;
  for (Hook* h = slot.get(); h != nullptr;) {
    auto* ours = as_ours(h);
    if (ours == nullptr) break;
    if (ours->owner == owner) {
      mine = ours;
      break;
    }
    if (dead == nullptr && ours->flags.expired()) dead = ours;
    h = ours->inner.get();
  }
  PresenceHook* reuse = mine != nullptr ? mine : dead;
  if (reuse == nullptr) {
    slot = std::make_unique<PresenceHook>(flags, i, owner, std::move(slot));
    return;
  }
  reuse->owner = owner;
  if (reuse->index != i ||
      reuse->flags._unsafe_get_target() != flags.storage().unsafeGetStorageImpl()) {
    reuse->flags = flags.storage().getWeakStorageImpl();     // (atomics: only on a change)
    reuse->index = i;
  }
}

}  // namespace

// watch(params, flags, owner) -> None: params[i] (each that requires grad and is a leaf;
// the others are skipped) gets a hook that sets flags[i], a contiguous CPU uint8 tensor.
PyObject* watch(PyObject* /*self*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject *ps, *fo;
  long long owner;
  if (!PyArg_ParseTuple(args, "OOL", &ps, &fo, &owner)) return nullptr;
  if (!THPVariable_Check(fo)) {
    PyErr_SetString(PyExc_TypeError, "watch: flags must be a tensor");
    return nullptr;
  }
  const at::Tensor& flags = THPVariable_Unpack(fo);
  Tensors t(ps);
  if (!t.ok()) return nullptr;
  if (!(flags.device().is_cpu() && flags.scalar_type() == at::kByte && flags.is_contiguous() &&
        flags.storage_offset() == 0 && flags.numel() >= t.n)) {
    PyErr_SetString(PyExc_ValueError,
                    "watch: flags must be a contiguous CPU uint8 tensor with a byte per parameter");
    return nullptr;
  }
  for (Py_ssize_t i = 0; i < t.n; ++i) {     // every item checked before any hook changes
    if (t.tensor(i) == nullptr) return nullptr;
  }
  for (Py_ssize_t i = 0; i < t.n; ++i) {
    const at::Tensor& p = *t.tensor(i);
    if (p.requires_grad() && p.is_leaf()) watch_one(p, flags, static_cast<int64_t>(i), owner);
  }
  Py_RETURN_NONE;
  END_HANDLE_TH_ERRORS
}

}  // namespace poco
