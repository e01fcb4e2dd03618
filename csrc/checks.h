// Argument checks shared by the ops' host-side planning (csrc/plan.cpp: the packing ops;
// csrc/quant.cpp: the quantized all-gather ops). Each raises a c10::Error whose message names
// the op, the argument, what it got and what was expected.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <string>

namespace fsdp_native {

// A dtype as Python spells it ("torch.float32").
std::string dtype_name(at::ScalarType t);

// The floating dtypes the kernels cast among: float32, bfloat16, float16.
bool is_cast_float(at::ScalarType t);

// "list[i]", the name of one tensor of a list argument.
std::string item_name(const char* list, size_t i);

void check_contiguous(const at::Tensor& t, const char* op, const std::string& name);

// `t` on `device`, the device of `buffer` (how the message names it: "the flat buffer", "'out'").
void check_device(const at::Tensor& t, const at::Device& device, const char* op,
                  const std::string& name, const char* buffer);

// `v` has one entry per tensor of the list argument `list_name`.
void check_count(at::IntArrayRef v, size_t n, const char* op, const char* name,
                 const char* list_name);

// Entry i of `padded_numels` is a non-negative element count.
void check_padded_entry(int64_t padded, size_t i, const char* op);

// `*out = a + b`; true if that overflows int64. c10::add_overflows has an int64 overload only
// from torch 2.10 (2.9's takes uint64), so the ops use the compiler's builtin on every torch.
inline bool add_overflows(int64_t a, int64_t b, int64_t* out) {
  return __builtin_add_overflow(a, b, out);
}

}  // namespace fsdp_native
