// Which parameters autograd reached: the `poco_kernels_cpp::watch` operator.
//
// The fused engine hands every trainable parameter a `.grad` that is a view of a zeroed
// flat buffer, so a parameter autograd never reached still has a (zero) `.grad`; it must
// be left out of the step, as torch.optim leaves out a `.grad` of None.  A hook on each
// parameter says which ones a backward reached: one byte per parameter of a bucket, set
// to 1 when autograd is about to accumulate a gradient into it, cleared by the engine
// when it hands the views out (poco_kernels/backends/fused_presence.py).
//
// A Python hook costs the backward about 1.3-2 us per parameter (the engine takes the
// GIL, wraps the tensor, calls the function); this one is a store.  It sits in the
// tensor's post-accumulate-grad slot (autograd keeps one hook object there; Python's
// `register_post_accumulate_grad_hook` puts its dict of hooks in it), and it keeps the
// object it found there and runs it first, so the user's hooks still run.  It holds its
// byte array weakly: once the engine is gone it only runs the hook it wraps.  Hooks are
// re-used, not stacked: `watch` re-points the hook of the same owner (a new layout of
// the same optimizer) or one whose array is gone.
//
// Where it does not run (a Python hook registered on a parameter with none before
// replaces the slot's object, until the engine's next `watch`; compiled autograd, which
// is given nothing to trace here) the byte stays 0 and the engine reads whether the view
// holds zeros instead.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/library.h>

#include <memory>
#include <vector>

namespace poco {
namespace {

using torch::autograd::variable_list;

using Hook = torch::autograd::PostAccumulateGradHook;

struct PresenceHook : Hook {
  c10::weak_intrusive_ptr<c10::StorageImpl> flags;
  int64_t index;
  int64_t owner;
  std::unique_ptr<Hook> inner;  // the object the slot held before (the user's hooks)

  PresenceHook(const at::Tensor& f, int64_t i, int64_t o, std::unique_ptr<Hook> in)
      : flags(f.storage().getWeakStorageImpl()), index(i), owner(o), inner(std::move(in)) {}

  void operator()(const torch::autograd::Variable& tensor) override {
    if (inner) (*inner)(tensor);
    if (auto s = flags.lock()) {
      static_cast<uint8_t*>(s->mutable_data())[index] = 1;
    }
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

// Give params[i] a hook that sets flags[i] (owner: the engine's token).
void watch_op(const at::TensorList params, const at::Tensor& flags, int64_t owner) {
  TORCH_CHECK(flags.device().is_cpu() && flags.scalar_type() == at::kByte &&
                  flags.is_contiguous() && flags.storage_offset() == 0 &&
                  flags.numel() >= static_cast<int64_t>(params.size()),
              "poco_kernels_cpp::watch: flags must be a contiguous CPU uint8 tensor with a "
              "byte per parameter");
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    TORCH_CHECK(p.requires_grad() && p.is_leaf(),
                "poco_kernels_cpp::watch: parameter ", i, " is not a leaf that requires grad");
    std::unique_ptr<Hook>& slot = torch::autograd::impl::post_acc_grad_hooks(p);
    PresenceHook* reuse = nullptr;
    for (Hook* h = slot.get(); h != nullptr;) {
      auto* ours = dynamic_cast<PresenceHook*>(h);
      if (ours == nullptr) break;
      if (ours->owner == owner || ours->flags.expired()) {
        reuse = ours;
        break;
      }
      h = ours->inner.get();
    }
    if (reuse != nullptr) {
      reuse->flags = flags.storage().getWeakStorageImpl();
      reuse->index = static_cast<int64_t>(i);
      reuse->owner = owner;
    } else {
      slot = std::make_unique<PresenceHook>(flags, static_cast<int64_t>(i), owner,
                                            std::move(slot));
    }
  }
}

}  // namespace
}  // namespace poco

// A catch-all kernel: the parameters may live on any device; only their autograd
// metadata is touched.
TORCH_LIBRARY_FRAGMENT(poco_kernels_cpp, m) {
  m.def("watch(Tensor[] params, Tensor flags, int owner) -> ()", &poco::watch_op);
}
