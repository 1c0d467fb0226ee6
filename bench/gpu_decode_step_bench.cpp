// Decode step of a full-width ML4 slice on the GPU (issue 6, "Decode step"): see
// src/runtime/cuda/step_bench.h for what each line measures. Also `ml4 bench step`.
//
// usage: gpu_decode_step_bench [copy_GBps=4253] [preset=ml4-slice-4]
#include <cstdio>
#include <cstdlib>
#include <string>

#if defined(ML4_WITH_CUDA)
#include "runtime/cuda/step_bench.h"

int main(int argc, char** argv) {
  ml4::cuda::StepBenchOptions o;
  if (argc > 1 && std::atof(argv[1]) > 0) o.copy_gbps = std::atof(argv[1]);
  if (argc > 2) o.preset = argv[2];
  return ml4::cuda::run_step_bench(o);
}
#else
int main() {
  std::printf("gpu_decode_step_bench: built without the CUDA backend\n");
  return 0;
}
#endif
