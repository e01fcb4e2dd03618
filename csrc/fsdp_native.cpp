// The op schemas of fsdp_native, declared once; kernels live in csrc/cpu and csrc/cuda.
#include <Python.h>
#include <torch/library.h>

extern "C" {
// `import fsdp_native._C` loads this library, which registers the ops below.
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  // The torch this library was compiled against, checked at import (ABI safety).
  PyModule_AddStringConstant(m, "torch_version", FSDPN_TORCH_VERSION);
#ifdef FSDPN_WITH_CUDA
  PyModule_AddIntConstant(m, "with_cuda", 1);
#else
  PyModule_AddIntConstant(m, "with_cuda", 0);
#endif
  return m;
}
}

TORCH_LIBRARY(fsdp_native, m) {
  m.def("all_gather_copy_in(Tensor[] shards, int[] padded_numels, Tensor(a!) out) -> ()");
  m.def(
      "all_gather_copy_out(Tensor all_gather_output, int[] padded_numels, int world_size, "
      "Tensor(a!)[] outs) -> ()");
  m.def(
      "reduce_scatter_copy_in(Tensor[] grads, int[] padded_numels, int world_size, "
      "Tensor(a!) out) -> ()");
  m.def(
      "reduce_scatter_copy_out(Tensor shard, int[] padded_numels, float divide_factor, "
      "bool accumulate, Tensor(a!)[] grads) -> ()");
  m.def("stream_wait(Tensor(a!) anchor, int waiter_stream, int signaler_stream) -> ()");
}
