#include "plan.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <algorithm>
#include <string>

namespace fsdp_native {
namespace {

bool is_cast_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

void check_flat(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.is_contiguous(), op, ": argument '", name,
              "' must be contiguous, got a tensor with sizes ", t.sizes(), " and strides ",
              t.strides());
}

void check_device(const at::Tensor& t, const at::Device& device, const char* op,
                  const std::string& name) {
  TORCH_CHECK(t.device() == device, op, ": argument '", name, "' is on device ", t.device(),
              ", expected ", device, " (the device of the flat buffer)");
}

// A dtype as Python spells it ("torch.float32").
std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    case at::kComplexFloat: return "torch.complex64";
    case at::kComplexDouble: return "torch.complex128";
    default: return std::string("torch.") + c10::toString(t);
  }
}

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
  TORCH_CHECK(padded.size() == n, op, ": argument 'padded_numels' has ", padded.size(),
              " entries, expected ", n, " (one per tensor of '", list_name, "')");
  int64_t total = 0;
  for (size_t i = 0; i < padded.size(); ++i) {
    TORCH_CHECK(padded[i] >= 0, op, ": argument 'padded_numels[", i, "]' is ", padded[i],
                ", expected a non-negative element count");
    TORCH_CHECK(!c10::add_overflows(total, padded[i], &total), op,
                ": argument 'padded_numels' sums to more than int64 can hold");
  }
}

int64_t sum(at::IntArrayRef v) {
  int64_t s = 0;
  for (auto x : v) s += x;
  return s;
}

// world_size x chunk, checked: both are validated non-negative / positive before.
int64_t times_world(int64_t chunk, int64_t world_size, const char* op) {
  int64_t out = 0;
  TORCH_CHECK(!c10::mul_overflows(chunk, world_size, &out), op, ": world_size ", world_size,
              " x sum of padded_numels ", chunk, " overflows int64");
  return out;
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

void check_world_size(int64_t world_size, const char* op) {
  TORCH_CHECK(world_size >= 1, op, ": argument 'world_size' is ", world_size,
              ", expected a positive integer");
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
  check_flat(out, op, "out");
  const int64_t total = sum(padded_numels);
  TORCH_CHECK(out.numel() == total, op, ": argument 'out' has ", out.numel(),
              " elements, expected ", total, " (the sum of padded_numels)");
  CopyPlan plan;
  plan.device = out.device();
  const auto dst_dtype = out.scalar_type();
  const int64_t dst_es = out.element_size();
  int64_t offset = 0;
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    const std::string name = "shards[" + std::to_string(i) + "]";
    check_device(s, plan.device, op, name);
    check_flat(s, op, name.c_str());
    check_pair(s.scalar_type(), dst_dtype, false, op, name);
    TORCH_CHECK(s.numel() <= padded_numels[i], op, ": argument '", name, "' has ", s.numel(),
                " elements, expected at most padded_numels[", i, "] = ", padded_numels[i]);
    add_segment(plan, s.scalar_type(), dst_dtype,
                Segment{byte_ptr(s), mut_byte_ptr(out) + offset * dst_es, s.numel(),
                        padded_numels[i] - s.numel()});
    offset += padded_numels[i];
  }
  return plan;
}

CopyPlan plan_all_gather_copy_out(const at::Tensor& all_gather_output,
                                  at::IntArrayRef padded_numels, int64_t world_size,
                                  at::TensorList outs) {
  constexpr const char* op = "fsdp_native::all_gather_copy_out";
  check_world_size(world_size, op);
  check_padded(padded_numels, outs.size(), op, "outs");
  check_flat(all_gather_output, op, "all_gather_output");
  const int64_t chunk = sum(padded_numels);
  const int64_t expected = times_world(chunk, world_size, op);
  TORCH_CHECK(all_gather_output.numel() == expected, op,
              ": argument 'all_gather_output' has ", all_gather_output.numel(),
              " elements, expected ", expected, " (world_size ", world_size,
              " x sum of padded_numels ", chunk, ")");
  CopyPlan plan;
  plan.device = all_gather_output.device();
  const auto src_dtype = all_gather_output.scalar_type();
  const int64_t src_es = all_gather_output.element_size();
  int64_t offset = 0;
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto& o = outs[i];
    const std::string name = "outs[" + std::to_string(i) + "]";
    check_device(o, plan.device, op, name);
    check_flat(o, op, name.c_str());
    check_pair(src_dtype, o.scalar_type(), false, op, name);
    const int64_t numel = o.numel();
    const int64_t padded = padded_numels[i];
    TORCH_CHECK(numel <= padded * world_size, op, ": argument '", name, "' has ", numel,
                " elements, expected at most world_size x padded_numels[", i, "] = ",
                padded * world_size);
    const int64_t dst_es = o.element_size();
    for (int64_t r = 0; r < world_size; ++r) {
      const int64_t valid = shard_valid_numel(numel, padded, r);
      if (valid == 0) break;
      add_segment(plan, src_dtype, o.scalar_type(),
                  Segment{byte_ptr(all_gather_output) + (r * chunk + offset) * src_es,
                          mut_byte_ptr(o) + r * padded * dst_es, valid, 0});
    }
    offset += padded;
  }
  return plan;
}

CopyPlan plan_reduce_scatter_copy_in(at::TensorList grads, at::IntArrayRef padded_numels,
                                     int64_t world_size, const at::Tensor& out) {
  constexpr const char* op = "fsdp_native::reduce_scatter_copy_in";
  check_world_size(world_size, op);
  check_padded(padded_numels, grads.size(), op, "grads");
  check_flat(out, op, "out");
  const int64_t chunk = sum(padded_numels);
  const int64_t expected = times_world(chunk, world_size, op);
  TORCH_CHECK(out.numel() == expected, op, ": argument 'out' has ", out.numel(),
              " elements, expected ", expected, " (world_size ", world_size,
              " x sum of padded_numels ", chunk, ")");
  CopyPlan plan;
  plan.device = out.device();
  const auto dst_dtype = out.scalar_type();
  const int64_t dst_es = out.element_size();
  int64_t offset = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    const std::string name = "grads[" + std::to_string(i) + "]";
    check_device(g, plan.device, op, name);
    check_flat(g, op, name.c_str());
    check_pair(g.scalar_type(), dst_dtype, false, op, name);
    const int64_t numel = g.numel();
    const int64_t padded = padded_numels[i];
    TORCH_CHECK(numel <= padded * world_size, op, ": argument '", name, "' has ", numel,
                " elements, expected at most world_size x padded_numels[", i, "] = ",
                padded * world_size);
    const int64_t src_es = g.element_size();
    for (int64_t r = 0; r < world_size; ++r) {
      const int64_t valid = shard_valid_numel(numel, padded, r);
      add_segment(plan, g.scalar_type(), dst_dtype,
                  Segment{byte_ptr(g) + r * padded * src_es,
                          mut_byte_ptr(out) + (r * chunk + offset) * dst_es, valid,
                          padded - valid});
    }
    offset += padded;
  }
  return plan;
}

CopyPlan plan_reduce_scatter_copy_out(const at::Tensor& shard, at::IntArrayRef padded_numels,
                                      double divide_factor, bool accumulate,
                                      at::TensorList grads) {
  constexpr const char* op = "fsdp_native::reduce_scatter_copy_out";
  check_padded(padded_numels, grads.size(), op, "grads");
  check_flat(shard, op, "shard");
  TORCH_CHECK(divide_factor > 0.0, op, ": argument 'divide_factor' is ", divide_factor,
              ", expected a positive number");
  const int64_t total = sum(padded_numels);
  TORCH_CHECK(shard.numel() == total, op, ": argument 'shard' has ", shard.numel(),
              " elements, expected ", total, " (the sum of padded_numels)");
  CopyPlan plan;
  plan.device = shard.device();
  plan.scale = 1.0 / divide_factor;
  plan.mode = accumulate ? Mode::kAccumulate : (divide_factor != 1.0 ? Mode::kScale : Mode::kCopy);
  const bool arithmetic = plan.mode != Mode::kCopy;
  const auto src_dtype = shard.scalar_type();
  const int64_t src_es = shard.element_size();
  int64_t offset = 0;
  for (size_t i = 0; i < grads.size(); ++i) {
    const auto& g = grads[i];
    const std::string name = "grads[" + std::to_string(i) + "]";
    check_device(g, plan.device, op, name);
    check_flat(g, op, name.c_str());
    check_pair(src_dtype, g.scalar_type(), arithmetic, op, name);
    TORCH_CHECK(g.numel() <= padded_numels[i], op, ": argument '", name, "' has ", g.numel(),
                " elements, expected at most padded_numels[", i, "] = ", padded_numels[i]);
    add_segment(plan, src_dtype, g.scalar_type(),
                Segment{byte_ptr(shard) + offset * src_es, mut_byte_ptr(g), g.numel(), 0});
    offset += padded_numels[i];
  }
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
    check_device(list[i], buffer.device(), op,
                 std::string(list_name) + "[" + std::to_string(i) + "]");
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
