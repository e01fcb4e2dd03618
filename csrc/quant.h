// Host-side planning of the quantized all-gather ops (csrc/quant.cpp): validated arguments
// turned into per-parameter segments of one rank's chunk. Device kernels (csrc/cpu/quant_cpu.cpp)
// run the plans; the element math is in quant_math.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Optional.h>

#include <string>
#include <vector>

#include "quant_math.h"

namespace fsdp_native {
namespace quant {

// One parameter of a unit as one rank's chunk holds it.
struct QuantParam {
  int64_t padded;     // elements of the padded shard
  int64_t row_numel;  // elements of a row (kFp8Rowwise)
  int64_t offset;     // byte offset of the segment in a rank's chunk
  SegmentLayout layout;
  // Quantize: this rank's shard (numel <= padded). Dequantize: the unsharded tensor
  // (numel <= world_size * padded).
  void* data;
  int64_t numel;
  at::ScalarType dtype;
};

struct QuantizePlan {
  int fmt;
  int64_t block;
  std::vector<QuantParam> params;
  uint8_t* out;                  // one rank's chunk
  const float* amax = nullptr;   // kFp8Tensorwise: given amax per parameter, else computed
};

struct DequantizePlan {
  int fmt;
  int64_t block;
  int64_t world_size;
  std::vector<QuantParam> params;
  const uint8_t* gathered;  // rank r's chunk starts at gathered + r * rank_stride
  int64_t rank_stride;
};

struct AmaxPlan {
  std::vector<QuantParam> params;  // data, numel, dtype only
  float* out;
};

QuantizePlan plan_quantize_copy_in(at::TensorList shards, at::IntArrayRef padded_numels,
                                   at::IntArrayRef row_numels, c10::string_view format,
                                   int64_t block_size, const c10::optional<at::Tensor>& amax,
                                   const at::Tensor& out);
DequantizePlan plan_dequantize_copy_out(const at::Tensor& gathered, at::IntArrayRef padded_numels,
                                        at::IntArrayRef row_numels, int64_t world_size,
                                        c10::string_view format, int64_t block_size,
                                        at::TensorList outs);
AmaxPlan plan_quantize_amax(at::TensorList shards, const at::Tensor& out);

// The kernels the CPU quant ops run on this machine: "avx512-vbmi", "avx512" or "portable",
// the best the CPU has, capped by FSDP_NATIVE_QUANT_ISA (csrc/cpu/quant_cpu.cpp).
std::string quant_cpu_isa();

}  // namespace quant
}  // namespace fsdp_native
