// Device's opaque stream and event handles (backend/device.hpp) and the CUDA runtime's objects
// they are on a CudaDevice: one conversion, shared by the device that makes them and the code
// that passes them to CUDA libraries (comm/cuda/nccl_comm.cpp). Include only in CUDA=1 sources.
#pragma once

#include <cuda_runtime.h>

#include "backend/device.hpp"

namespace shardtrain {

inline cudaStream_t cuda_stream(DeviceStream* stream) { return reinterpret_cast<cudaStream_t>(stream); }
inline DeviceStream* device_stream(cudaStream_t stream) { return reinterpret_cast<DeviceStream*>(stream); }
inline cudaEvent_t cuda_event(DeviceEvent* event) { return reinterpret_cast<cudaEvent_t>(event); }
inline DeviceEvent* device_event(cudaEvent_t event) { return reinterpret_cast<DeviceEvent*>(event); }

}  // namespace shardtrain
