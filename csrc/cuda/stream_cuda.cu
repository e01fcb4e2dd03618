// CUDA kernel of fsdp_native::stream_wait: the waiter stream waits, on the device, for
// the work queued so far on the signaler stream. One event, no recordStream, no host sync.
#include <ATen/core/Tensor.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/core/Stream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

namespace fsdp_native {
namespace {

// Stream ids are torch.cuda.Stream.stream_id values (0: the device's default stream) of
// streams on `anchor`'s device.
void stream_wait_cuda(const at::Tensor& anchor, int64_t waiter_stream, int64_t signaler_stream) {
  if (waiter_stream == signaler_stream) return;  // a stream is always ordered after itself
  const c10::DeviceIndex device = anchor.device().index();
  const c10::cuda::CUDAGuard guard(anchor.device());
  const c10::cuda::CUDAStream waiter(
      c10::Stream::unpack3(waiter_stream, device, c10::DeviceType::CUDA));
  const c10::cuda::CUDAStream signaler(
      c10::Stream::unpack3(signaler_stream, device, c10::DeviceType::CUDA));
  at::cuda::CUDAEvent event;  // cudaEventDisableTiming
  event.record(signaler);
  event.block(waiter);
  // Destroying the event now is fine: cudaStreamWaitEvent has captured the recorded work.
}

}  // namespace

TORCH_LIBRARY_IMPL(fsdp_native, CUDA, m) { m.impl("stream_wait", &stream_wait_cuda); }

}  // namespace fsdp_native
