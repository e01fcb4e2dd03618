#include "plan.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "checks.h"

namespace fsdp_native {
namespace {

constexpr const char* kFlatBuffer = "the flat buffer";

void check_pair(at::ScalarType src, at::ScalarType dst, bool arithmetic, const char* op,
                const std::string& name) {
  TORCH_CHECK(dtype_pair_supported(src, dst, arithmetic), op, ": unsupported dtype pair for '",
              name, "': ", dtype_name(src), " -> ", dtype_name(dst),
              arithmetic ? "; divide_factor != 1 or accumulate=True expects floating dtypes "
                           "among torch.float32, torch.bfloat16, torch.float16"
                         : "; expected equal dtypes, or a cast among torch.float32, "
                           "torch.bfloat16, torch.float16 (view other dtypes as torch.uint8 "
                           "to pack them together)");
}

void check_padded(at::IntArrayRef padded, size_t n, const char* op, const char* list_name) {
  check_count(padded, n, op, "padded_numels", list_name);
  int64_t total = 0;
  for (size_t i = 0; i < padded.size(); ++i) {
    check_padded_entry(padded[i], i, op);
    TORCH_CHECK(!add_overflows(total, padded[i], &total), op,
                ": argument 'padded_numels' sums to more than int64 can hold");
  }
}

int64_t sum(at::IntArrayRef v) {
  int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}

void check_world_size(int64_t world_size, const char* op) {
  TORCH_CHECK(world_size >= 1, op, ": argument 'world_size' is ", world_size,
              ", expected a positive integer");
}

// The flat buffer of one rank's chunk: sum(padded_numels) elements.
void check_rank_buffer(const at::Tensor& t, at::IntArrayRef padded, const char* op,
                       const char* name) {
  check_contiguous(t, op, name);
  const int64_t total = sum(padded);
  TORCH_CHECK(t.numel() == total, op, ": argument '", name, "' has ", t.numel(),
              " elements, expected ", total, " (the sum of padded_numels)");
}

// The flat buffer of every rank's chunk: world_size x sum(padded_numels) elements (padded
// already checked: its sum fits). Returns the chunk.
int64_t check_world_buffer(const at::Tensor& t, at::IntArrayRef padded, int64_t world_size,
                           const char* op, const char* name) {
  check_contiguous(t, op, name);
  const int64_t chunk = sum(padded);
  int64_t expected = 0;
  TORCH_CHECK(!c10::mul_overflows(chunk, world_size, &expected), op, ": world_size ", world_size,
              " x sum of padded_numels ", chunk, " overflows int64");
  TORCH_CHECK(t.numel() == expected, op, ": argument '", name, "' has ", t.numel(),
              " elements, expected ", expected, " (world_size ", world_size,
              " x sum of padded_numels ", chunk, ")");
  return chunk;
}

// One tensor of a list argument: on the flat buffer's device, contiguous, and a dtype pair
// with the buffer that the kernels copy.
void check_item(const at::Tensor& t, const at::Device& device, at::ScalarType src,
                at::ScalarType dst, bool arithmetic, const char* op, const std::string& name) {
  check_device(t, device, op, name, kFlatBuffer);
  check_contiguous(t, op, name);
  check_pair(src, dst, arithmetic, op, name);
}

// Tensor i of a list holds at most its padded_numels entry (times world_size for an unsharded
// tensor: world_size > 0).
void check_at_most(const at::Tensor& t, int64_t padded, size_t i, int64_t world_size,
                   const char* op, const std::string& name) {
  if (world_size == 0) {
    TORCH_CHECK(t.numel() <= padded, op, ": argument '", name, "' has ", t.numel(),
                " elements, expected at most padded_numels[", i, "] = ", padded);
  } else {
    TORCH_CHECK(t.numel() <= padded * world_size, op, ": argument '", name, "' has ", t.numel(),
                " elements, expected at most world_size x padded_numels[", i, "] = ",
                padded * world_size);
  }
}

// Adds `seg` to the group of its dtype pair (groups are few, linear search is fine).
void add_segment(CopyPlan& plan, at::ScalarType src, at::ScalarType dst, const Segment& seg) {
  if (seg.n_copy + seg.n_zero == 0) return;
  for (auto& g : plan.groups) {
    if (g.src_dtype == src && g.dst_dtype == dst) {
      g.segments.push_back(seg);
      return;
    }
  }
  plan.groups.push_back(CopyGroup{src, dst, {seg}});
}

const char* byte_ptr(const at::Tensor& t) { return static_cast<const char*>(t.const_data_ptr()); }
char* mut_byte_ptr(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// Segments between a flat buffer and a list of tensors, slot i of each rank's chunk <-> tensor
// i's slice for that rank. `world_size` 0: `buffer` is one rank's chunk and the tensors are
// its shards (all_gather_copy_in, reduce_scatter_copy_out); else it is every rank's chunk
// ([world_size][chunk]) and the tensors are unsharded (reduce_scatter_copy_in,
// all_gather_copy_out). `into_buffer`: tensors -> buffer, zero-filling each slot past the
// tensor's end; else buffer -> tensors, the padding left out, in `plan.mode`.
void add_segments(CopyPlan& plan, const at::Tensor& buffer, at::IntArrayRef padded_numels,
                  int64_t world_size, int64_t chunk, at::TensorList list, bool into_buffer,
                  const char* op, const char* list_name) {
  const auto dtype = buffer.scalar_type();
  const int64_t buffer_es = buffer.element_size();
  const bool arithmetic = plan.mode != Mode::kCopy;
  int64_t offset = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const auto& t = list[i];
    const std::string name = item_name(list_name, i);
    const auto src = into_buffer ? t.scalar_type() : dtype, dst = into_buffer ? dtype : t.scalar_type();
    check_item(t, plan.device, src, dst, arithmetic, op, name);
    check_at_most(t, padded_numels[i], i, world_size, op, name);
    const int64_t padded = padded_numels[i];
    const int64_t es = t.element_size();
    for (int64_t r = 0; r < std::max<int64_t>(world_size, 1); ++r) {
      const int64_t valid = shard_valid_numel(t.numel(), padded, r);
      const int64_t slot = (r * chunk + offset) * buffer_es;
      if (into_buffer) {
        add_segment(plan, src, dst, Segment{byte_ptr(t) + r * padded * es, mut_byte_ptr(buffer) + slot,
                                            valid, padded - valid});
      } else {
        if (valid == 0) break;
        add_segment(plan, src, dst, Segment{byte_ptr(buffer) + slot, mut_byte_ptr(t) + r * padded * es, valid, 0});
      }
    }
    offset += padded;
  }
}

}  // namespace

bool dtype_pair_supported(at::ScalarType src, at::ScalarType dst, bool arithmetic) {
  if (arithmetic) return is_cast_float(src) && is_cast_float(dst);
  return src == dst || (is_cast_float(src) && is_cast_float(dst));
}

CopyPlan plan_all_gather_copy_in(at::TensorList shards, at::IntArrayRef padded_numels,
                                 const at::Tensor& out) {
  constexpr const char* op = "fsdp_native::all_gather_copy_in";
  check_padded(padded_numels, shards.size(), op, "shards");
  check_rank_buffer(out, padded_numels, op, "out");
  CopyPlan plan;
  plan.device = out.device();
  add_segments(plan, out, padded_numels, 0, 0, shards, true, op, "shards");
  return plan;
}

CopyPlan plan_all_gather_copy_out(const at::Tensor& all_gather_output,
                                  at::IntArrayRef padded_numels, int64_t world_size,
                                  at::TensorList outs) {
  constexpr const char* op = "fsdp_native::all_gather_copy_out";
  check_world_size(world_size, op);
  check_padded(padded_numels, outs.size(), op, "outs");
  const int64_t chunk =
      check_world_buffer(all_gather_output, padded_numels, world_size, op, "all_gather_output");
  CopyPlan plan;
  plan.device = all_gather_output.device();
  add_segments(plan, all_gather_output, padded_numels, world_size, chunk, outs, false, op, "outs");
  return plan;
}

CopyPlan plan_reduce_scatter_copy_in(at::TensorList grads, at::IntArrayRef padded_numels,
                                     int64_t world_size, const at::Tensor& out) {
  constexpr const char* op = "fsdp_native::reduce_scatter_copy_in";
  check_world_size(world_size, op);
  check_padded(padded_numels, grads.size(), op, "grads");
  const int64_t chunk = check_world_buffer(out, padded_numels, world_size, op, "out");
  CopyPlan plan;
  plan.device = out.device();
  add_segments(plan, out, padded_numels, world_size, chunk, grads, true, op, "grads");
  return plan;
}

CopyPlan plan_reduce_scatter_copy_out(const at::Tensor& shard, at::IntArrayRef padded_numels,
                                      double divide_factor, bool accumulate,
                                      at::TensorList grads) {
  constexpr const char* op = "fsdp_native::reduce_scatter_copy_out";
  check_padded(padded_numels, grads.size(), op, "grads");
  TORCH_CHECK(divide_factor > 0.0, op, ": argument 'divide_factor' is ", divide_factor,
              ", expected a positive number");
  check_rank_buffer(shard, padded_numels, op, "shard");
  CopyPlan plan;
  plan.device = shard.device();
  plan.scale = 1.0 / divide_factor;
  plan.mode = accumulate ? Mode::kAccumulate : (divide_factor != 1.0 ? Mode::kScale : Mode::kCopy);
  add_segments(plan, shard, padded_numels, 0, 0, grads, false, op, "grads");
  return plan;
}

// --- device check ahead of every backend ------------------------------------------------
//
// The dispatcher picks one kernel from the devices of all tensor arguments, and the Meta key
// outranks CPU: a meta tensor among CPU tensors would reach the fake (Meta) kernel and pass
// silently. BackendSelect runs before any backend kernel, so the device check lives there and
// the call then goes on to the kernel the dispatcher would have picked anyway.
namespace {

void check_devices(const char* op, const at::Tensor& buffer, at::TensorList list,
                   const char* list_name) {
  for (size_t i = 0; i < list.size(); ++i) {
    check_device(list[i], buffer.device(), op, item_name(list_name, i), kFlatBuffer);
  }
}

c10::DispatchKeySet after_backend_select(c10::DispatchKeySet ks) {
  return ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);
}

void all_gather_copy_in_select(c10::DispatchKeySet ks, at::TensorList shards,
                               at::IntArrayRef padded_numels, const at::Tensor& out) {
  check_devices("fsdp_native::all_gather_copy_in", out, shards, "shards");
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_native::all_gather_copy_in", "")
          .typed<void(at::TensorList, at::IntArrayRef, const at::Tensor&)>();
  handle.redispatch(after_backend_select(ks), shards, padded_numels, out);
}

void all_gather_copy_out_select(c10::DispatchKeySet ks, const at::Tensor& all_gather_output,
                                at::IntArrayRef padded_numels, int64_t world_size,
                                at::TensorList outs) {
  check_devices("fsdp_native::all_gather_copy_out", all_gather_output, outs, "outs");
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_native::all_gather_copy_out", "")
          .typed<void(const at::Tensor&, at::IntArrayRef, int64_t, at::TensorList)>();
  handle.redispatch(after_backend_select(ks), all_gather_output, padded_numels, world_size, outs);
}

void reduce_scatter_copy_in_select(c10::DispatchKeySet ks, at::TensorList grads,
                                   at::IntArrayRef padded_numels, int64_t world_size,
                                   const at::Tensor& out) {
  check_devices("fsdp_native::reduce_scatter_copy_in", out, grads, "grads");
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_native::reduce_scatter_copy_in", "")
          .typed<void(at::TensorList, at::IntArrayRef, int64_t, const at::Tensor&)>();
  handle.redispatch(after_backend_select(ks), grads, padded_numels, world_size, out);
}

void reduce_scatter_copy_out_select(c10::DispatchKeySet ks, const at::Tensor& shard,
                                    at::IntArrayRef padded_numels, double divide_factor,
                                    bool accumulate, at::TensorList grads) {
  check_devices("fsdp_native::reduce_scatter_copy_out", shard, grads, "grads");
  static const auto handle =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("fsdp_native::reduce_scatter_copy_out", "")
          .typed<void(const at::Tensor&, at::IntArrayRef, double, bool, at::TensorList)>();
  handle.redispatch(after_backend_select(ks), shard, padded_numels, divide_factor, accumulate,
                    grads);
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_native, BackendSelect, m) {
  m.impl("all_gather_copy_in", TORCH_FN(all_gather_copy_in_select));
  m.impl("all_gather_copy_out", TORCH_FN(all_gather_copy_out_select));
  m.impl("reduce_scatter_copy_in", TORCH_FN(reduce_scatter_copy_in_select));
  m.impl("reduce_scatter_copy_out", TORCH_FN(reduce_scatter_copy_out_select));
}

}  // namespace fsdp_native
