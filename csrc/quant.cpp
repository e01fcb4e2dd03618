// Schemas and planning of the quantized all-gather ops (fp8 e4m3 tensorwise / rowwise, NF4):
// argument validation shared by every device, and the segment layout of quant_math.h.
// The CPU kernels are in csrc/cpu/quant_cpu.cpp; Triton kernels for CUDA tensors are
// registered from Python (kernels/quant.py) under their own op names.
#include "quant.h"

#include <c10/util/Exception.h>
#include <c10/util/safe_numerics.h>
#include <torch/library.h>

#include <string>

#include "checks.h"

namespace fsdp_native {
namespace quant {
namespace {

constexpr int64_t kMaxBlock = 4096;

int parse_format(c10::string_view format, const char* op) {
  if (format == "fp8_tensorwise") return kFp8Tensorwise;
  if (format == "fp8_rowwise") return kFp8Rowwise;
  if (format == "nf4") return kNf4;
  TORCH_CHECK(false, op, ": argument 'format' is '", std::string(format),
              "', expected one of 'fp8_tensorwise', 'fp8_rowwise', 'nf4'");
}

void check_block(int fmt, int64_t block, const char* op) {
  if (fmt != kNf4) return;
  TORCH_CHECK(block >= 2 && block <= kMaxBlock && (block & (block - 1)) == 0, op,
              ": argument 'block_size' is ", block, ", expected a power of two from 2 to ",
              kMaxBlock);
}

// Tensor i of the list `list`: on the device of `buffer`, a floating dtype, contiguous.
// Returns its name.
std::string check_float_item(at::TensorList list, size_t i, const char* list_name,
                             const at::Tensor& buffer, const char* buffer_name, const char* op) {
  const auto& t = list[i];
  std::string name = item_name(list_name, i);
  check_device(t, buffer.device(), op, name, buffer_name);
  TORCH_CHECK(is_cast_float(t.scalar_type()), op, ": argument '", name, "' has dtype ",
              dtype_name(t.scalar_type()),
              ", expected torch.float32, torch.bfloat16 or torch.float16");
  check_contiguous(t, op, name);
  return name;
}

void check_bytes(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kByte, op, ": argument '", name, "' has dtype ",
              dtype_name(t.scalar_type()), ", expected torch.uint8");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 4 == 0, op, ": argument '", name,
              "' starts at an address that is not a multiple of 4, expected 4-byte alignment "
              "(the fp32 scales are read in place)");
}

// Per-parameter segments of one rank's chunk; returns the chunk's bytes.
int64_t lay_out(int fmt, int64_t block, at::IntArrayRef padded_numels, at::IntArrayRef row_numels,
                std::vector<QuantParam>& params, const char* op) {
  int64_t offset = 0;
  for (size_t i = 0; i < padded_numels.size(); ++i) {
    const int64_t padded = padded_numels[i], row = row_numels[i];
    check_padded_entry(padded, i, op);
    TORCH_CHECK(padded <= (int64_t{1} << 60), op, ": argument 'padded_numels[", i, "]' is ",
                padded, ", expected at most 2^60");
    TORCH_CHECK(row >= 0, op, ": argument 'row_numels[", i, "]' is ", row,
                ", expected a non-negative element count");
    if (fmt == kFp8Rowwise && padded > 0) {
      TORCH_CHECK(row > 0 && padded % row == 0, op, ": argument 'padded_numels[", i, "]' is ",
                  padded, ", expected a multiple of row_numels[", i, "] = ", row,
                  " (fp8_rowwise has one scale per whole row)");
    }
    QuantParam p{};
    p.padded = padded;
    p.row_numel = row;
    p.offset = offset;
    p.layout = segment_layout(fmt, padded, row, block);
    TORCH_CHECK(!add_overflows(offset, p.layout.nbytes, &offset), op,
                ": the encoded unit is larger than int64 can hold");
    params.push_back(p);
  }
  return offset;
}

}  // namespace

QuantizePlan plan_quantize_copy_in(at::TensorList shards, at::IntArrayRef padded_numels,
                                   at::IntArrayRef row_numels, c10::string_view format,
                                   int64_t block_size, const c10::optional<at::Tensor>& amax,
                                   const at::Tensor& out) {
  constexpr const char* op = "fsdp_native::quantize_copy_in";
  QuantizePlan plan;
  plan.fmt = parse_format(format, op);
  plan.block = block_size;
  check_block(plan.fmt, block_size, op);
  check_count(padded_numels, shards.size(), op, "padded_numels", "shards");
  check_count(row_numels, shards.size(), op, "row_numels", "shards");
  check_bytes(out, op, "out");
  check_contiguous(out, op, "out");
  const int64_t nbytes = lay_out(plan.fmt, block_size, padded_numels, row_numels, plan.params, op);
  TORCH_CHECK(out.numel() == nbytes, op, ": argument 'out' has ", out.numel(),
              " bytes, expected ", nbytes, " (one rank's encoded chunk of the unit, "
              "fsdp_native.quant.unit_layout(...).rank_nbytes)");
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    const std::string name = check_float_item(shards, i, "shards", out, "'out'", op);
    TORCH_CHECK(s.numel() <= padded_numels[i], op, ": argument '", name, "' has ", s.numel(),
                " elements, expected at most padded_numels[", i, "] = ", padded_numels[i]);
    auto& p = plan.params[i];
    p.data = const_cast<void*>(s.const_data_ptr());
    p.numel = s.numel();
    p.dtype = s.scalar_type();
  }
  if (amax.has_value()) {
    const auto& a = *amax;
    TORCH_CHECK(plan.fmt == kFp8Tensorwise, op, ": argument 'amax' is a tensor, expected None "
                "for format '", std::string(format), "' (only fp8_tensorwise takes a given amax)");
    check_device(a, out.device(), op, "amax", "'out'");
    TORCH_CHECK(a.scalar_type() == at::kFloat, op, ": argument 'amax' has dtype ",
                dtype_name(a.scalar_type()), ", expected torch.float32");
    check_contiguous(a, op, "amax");
    TORCH_CHECK(a.numel() == static_cast<int64_t>(shards.size()), op, ": argument 'amax' has ",
                a.numel(), " elements, expected ", shards.size(), " (one per tensor of 'shards')");
    plan.amax = a.const_data_ptr<float>();
  }
  plan.out = static_cast<uint8_t*>(out.data_ptr());
  return plan;
}

DequantizePlan plan_dequantize_copy_out(const at::Tensor& gathered, at::IntArrayRef padded_numels,
                                        at::IntArrayRef row_numels, int64_t world_size,
                                        c10::string_view format, int64_t block_size,
                                        at::TensorList outs) {
  constexpr const char* op = "fsdp_native::dequantize_copy_out";
  DequantizePlan plan;
  plan.fmt = parse_format(format, op);
  plan.block = block_size;
  plan.world_size = world_size;
  check_block(plan.fmt, block_size, op);
  TORCH_CHECK(world_size >= 1, op, ": argument 'world_size' is ", world_size,
              ", expected a positive integer");
  check_count(padded_numels, outs.size(), op, "padded_numels", "outs");
  check_count(row_numels, outs.size(), op, "row_numels", "outs");
  check_bytes(gathered, op, "gathered");
  const int64_t nbytes = lay_out(plan.fmt, block_size, padded_numels, row_numels, plan.params, op);
  int64_t total = 0;
  TORCH_CHECK(!c10::mul_overflows(nbytes, world_size, &total), op,
              ": world_size x the encoded chunk overflows int64");
  if (gathered.dim() == 2) {
    // [world_size, chunk] rows of a larger buffer (quantized bytes first in each rank's chunk).
    TORCH_CHECK(gathered.size(0) == world_size && gathered.size(1) == nbytes &&
                    (gathered.stride(1) == 1 || nbytes <= 1) &&
                    (gathered.stride(0) >= nbytes || world_size == 1) &&
                    gathered.stride(0) % 4 == 0,
                op, ": argument 'gathered' has sizes ", gathered.sizes(), " and strides ",
                gathered.strides(), ", expected sizes [", world_size, ", ", nbytes,
                "] with strides [a multiple of 4 of at least ", nbytes, ", 1]");
    plan.rank_stride = gathered.stride(0);
  } else {
    TORCH_CHECK(gathered.dim() == 1 && gathered.numel() == total && gathered.is_contiguous(), op,
                ": argument 'gathered' has sizes ", gathered.sizes(), ", expected a contiguous [",
                total, "] (world_size ", world_size, " x the encoded chunk of ", nbytes,
                " bytes) or a [world_size, ", nbytes, "] view with unit inner stride");
    plan.rank_stride = nbytes;
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto& o = outs[i];
    const std::string name = check_float_item(outs, i, "outs", gathered, "'gathered'", op);
    int64_t capacity = 0;
    TORCH_CHECK(!c10::mul_overflows(padded_numels[i], world_size, &capacity), op,
                ": world_size x padded_numels[", i, "] overflows int64");
    TORCH_CHECK(o.numel() <= capacity, op, ": argument '", name, "' has ", o.numel(),
                " elements, expected at most world_size x padded_numels[", i, "] = ", capacity);
    auto& p = plan.params[i];
    p.data = o.data_ptr();
    p.numel = o.numel();
    p.dtype = o.scalar_type();
  }
  plan.gathered = static_cast<const uint8_t*>(gathered.const_data_ptr());
  return plan;
}

AmaxPlan plan_quantize_amax(at::TensorList shards, const at::Tensor& out) {
  constexpr const char* op = "fsdp_native::quantize_amax";
  AmaxPlan plan;
  TORCH_CHECK(out.scalar_type() == at::kFloat, op, ": argument 'out' has dtype ",
              dtype_name(out.scalar_type()), ", expected torch.float32");
  check_contiguous(out, op, "out");
  TORCH_CHECK(out.numel() == static_cast<int64_t>(shards.size()), op, ": argument 'out' has ",
              out.numel(), " elements, expected ", shards.size(), " (one per tensor of 'shards')");
  for (size_t i = 0; i < shards.size(); ++i) {
    const auto& s = shards[i];
    const std::string name = check_float_item(shards, i, "shards", out, "'out'", op);
    QuantParam p{};
    p.data = const_cast<void*>(s.const_data_ptr());
    p.numel = s.numel();
    p.dtype = s.scalar_type();
    plan.params.push_back(p);
  }
  plan.out = out.data_ptr<float>();
  return plan;
}

}  // namespace quant
}  // namespace fsdp_native

TORCH_LIBRARY_FRAGMENT(fsdp_native, m) {
  m.def(
      "quantize_copy_in(Tensor[] shards, int[] padded_numels, int[] row_numels, str format, "
      "int block_size, Tensor? amax, Tensor(a!) out) -> ()");
  m.def(
      "dequantize_copy_out(Tensor gathered, int[] padded_numels, int[] row_numels, "
      "int world_size, str format, int block_size, Tensor(a!)[] outs) -> ()");
  m.def("quantize_amax(Tensor[] shards, Tensor(a!) out) -> ()");
  // No tensors, so no dispatch: which CPU kernels the ops above run (tests, benchmarks).
  m.def("quant_cpu_isa() -> str", &fsdp_native::quant::quant_cpu_isa);
}
