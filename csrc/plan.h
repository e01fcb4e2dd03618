// Host-side planning shared by every device: validate an op's arguments and
// turn it into groups of copy segments, one group per (src, dst) dtype pair.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <vector>

#include "packing_index.h"

namespace fsdp_native {

// How a segment's elements combine with the destination.
enum class Mode : int {
  kCopy = 0,        // dst = cast(src)
  kScale = 1,       // dst = cast(src * scale)
  kAccumulate = 2,  // dst = cast(dst + src * scale)
};

struct CopyGroup {
  at::ScalarType src_dtype;
  at::ScalarType dst_dtype;
  std::vector<Segment> segments;
};

struct CopyPlan {
  std::vector<CopyGroup> groups;
  Mode mode = Mode::kCopy;
  double scale = 1.0;
  at::Device device = at::kCPU;
};

CopyPlan plan_all_gather_copy_in(at::TensorList shards, at::IntArrayRef padded_numels,
                                 const at::Tensor& out);
CopyPlan plan_all_gather_copy_out(const at::Tensor& all_gather_output,
                                  at::IntArrayRef padded_numels, int64_t world_size,
                                  at::TensorList outs);
CopyPlan plan_reduce_scatter_copy_in(at::TensorList grads, at::IntArrayRef padded_numels,
                                     int64_t world_size, const at::Tensor& out);
CopyPlan plan_reduce_scatter_copy_out(const at::Tensor& shard, at::IntArrayRef padded_numels,
                                      double divide_factor, bool accumulate, at::TensorList grads);

// Device executors (one per device, in csrc/cpu and csrc/cuda).
void run_plan_cpu(const CopyPlan& plan);
void run_plan_cuda(const CopyPlan& plan);

// Whether a (src, dst) dtype pair may be copied; `accumulate_or_scale` needs floating dtypes.
bool dtype_pair_supported(at::ScalarType src, at::ScalarType dst, bool arithmetic);

}  // namespace fsdp_native
