#include "checks.h"

#include <c10/util/Exception.h>

namespace fsdp_native {

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

bool is_cast_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

std::string item_name(const char* list, size_t i) {
  return std::string(list) + "[" + std::to_string(i) + "]";
}

void check_contiguous(const at::Tensor& t, const char* op, const std::string& name) {
  TORCH_CHECK(t.is_contiguous(), op, ": argument '", name,
              "' must be contiguous, got a tensor with sizes ", t.sizes(), " and strides ",
              t.strides());
}

void check_device(const at::Tensor& t, const at::Device& device, const char* op,
                  const std::string& name, const char* buffer) {
  TORCH_CHECK(t.device() == device, op, ": argument '", name, "' is on device ", t.device(),
              ", expected ", device, " (the device of ", buffer, ")");
}

void check_count(at::IntArrayRef v, size_t n, const char* op, const char* name,
                 const char* list_name) {
  TORCH_CHECK(v.size() == n, op, ": argument '", name, "' has ", v.size(), " entries, expected ",
              n, " (one per tensor of '", list_name, "')");
}

void check_padded_entry(int64_t padded, size_t i, const char* op) {
  TORCH_CHECK(padded >= 0, op, ": argument 'padded_numels[", i, "]' is ", padded,
              ", expected a non-negative element count");
}

}  // namespace fsdp_native
