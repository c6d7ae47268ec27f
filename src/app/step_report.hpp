// The training loop's step report (docs/monitoring.md): what every rank contributes to the one MAX
// all-reduce at the end of a step (StepMaxima), the step's metrics record as JSON, and the host
// memory probes the start-up check and the report read.
#pragma once

#include <array>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/device.hpp"
#include "backend/phase_timer.hpp"
#include "shard/memory.hpp"

namespace shardtrain {

// "1h02m", "3m05s", "42s".
std::string format_duration(double seconds);

// What every rank contributes to the one MAX all-reduce at the end of a step: peak bytes per
// memory category and in total, the stop signal, resident growth, bytes sent.
// DEVICE_RESERVED: what the GPU's caching allocator took at most (0 on the CPU backend).
// HELD: the most the device's arrays held at once, counted at allocation (the plan's check).
// HOST_SYNCS: the times the host waited for the compute device during the step (Device::host_syncs).
// PHASE_SECONDS + p: the seconds of the step's phase p (backend/phase_timer.hpp) on the slowest rank.
constexpr int PEAK_TOTAL = MEM_CATEGORY_COUNT, STOP_SIGNAL = MEM_CATEGORY_COUNT + 1,
              RSS_GROWTH = MEM_CATEGORY_COUNT + 2, COMM_BYTES = MEM_CATEGORY_COUNT + 3,
              DEVICE_RESERVED = MEM_CATEGORY_COUNT + 4, HELD = MEM_CATEGORY_COUNT + 5,
              HOST_SYNCS = MEM_CATEGORY_COUNT + 6, PHASE_SECONDS = MEM_CATEGORY_COUNT + 7;
using StepMaxima = std::array<double, PHASE_SECONDS + PHASE_COUNT>;

// A field of /proc/self/status in bytes (VmRSS, VmHWM), or 0.
double proc_status_bytes(const char* field);
// Memory this node can still give: MemAvailable, or less where a cgroup limit says so; 0 if unknown.
double node_available_bytes();
// This rank's maxima of the step but the bytes sent and the phases. `comm_buffers`: the
// communicators' own buffers outside the device's count (Comm::uncounted_buffer_bytes).
StepMaxima local_step_maxima(const MemoryTracker& m, double rss_at_start, const Device& device, size_t comm_buffers);
// The step's record in the metrics file: one JSON object. A loss or norm that is not finite is
// null; byte counts are whole numbers.
nlohmann::ordered_json step_record(int step, const StepMaxima& p, double loss, double lr, double grad_norm,
                                   double tokens_per_s, double mfu, double seconds, double planned_bytes);

}  // namespace shardtrain
