// NcclCommunicator: the Communicator of CUDA ranks (SYSTEM.md S10): buffers are device memory
// and every collective is issued on the stream the model program's ops run on (the backend's
// queue()), so it is ordered after the op that made its input and can be captured in a CUDA
// graph, as vLLM's and TensorRT-LLM's NCCL calls are.
//
// Bootstrap as TensorRT-LLM's opUtils.cpp does it: the group's first rank makes the unique id
// (ncclGetUniqueId) and broadcasts its 128 bytes over the group's MPI communicator; every
// member then calls ncclCommInitRank. A group of one needs no MPI (the single-GPU case:
// bootstrap null). Host metadata (exchange_counts) goes over the bootstrap communicator.
//
// NCCL comes from the CUDA toolkit on the build machine and from PyTorch's site-packages
// (nvidia/nccl/lib) on the GPU machine (FIELD-NOTES.md); CMake builds this only where nccl.h
// and libnccl are found (ML4_WITH_NCCL).
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "core/status.h"
#include "parallel/communicator.h"

namespace ml4 {

// bootstrap: the group's MPI communicator (host memory), or null for a group of one.
Result<std::unique_ptr<Communicator>> make_nccl_communicator(Communicator* bootstrap, cudaStream_t stream);

}  // namespace ml4
