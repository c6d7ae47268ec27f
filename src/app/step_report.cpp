// See step_report.hpp.
#include "app/step_report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>

#include "app/signals.hpp"
#include "core/error.hpp"

namespace shardtrain {

std::string format_duration(double seconds) {
  long s = std::lround(std::max(0.0, seconds));
  if (s >= 3600) return strprintf("%ldh%02ldm", s / 3600, (s / 60) % 60);
  if (s >= 60) return strprintf("%ldm%02lds", s / 60, s % 60);
  return strprintf("%lds", s);
}


double proc_status_bytes(const char* field) {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.compare(0, std::strlen(field), field) == 0 && line[std::strlen(field)] == ':')
      return std::atof(line.c_str() + std::strlen(field) + 1) * 1024;  // reported in kB
  return 0;
}

double node_available_bytes() {
  double available = 0;
  std::ifstream meminfo("/proc/meminfo");
  for (std::string key; meminfo >> key;) {
    double kib = 0;
    meminfo >> kib;
    meminfo.ignore(64, '\n');
    if (key == "MemAvailable:") available = kib * 1024;
  }
  std::ifstream max_file("/sys/fs/cgroup/memory.max"), current_file("/sys/fs/cgroup/memory.current");
  std::string max_text;
  double current = 0;
  if (max_file >> max_text && max_text != "max" && current_file >> current) {
    const double cgroup_left = std::atof(max_text.c_str()) - current;
    if (available <= 0 || cgroup_left < available) available = std::max(0.0, cgroup_left);
  }
  return available;
}

StepMaxima local_step_maxima(const MemoryTracker& m, double rss_at_start, const Device& device, size_t comm_buffers) {
  StepMaxima p{};
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) p[c] = static_cast<double>(m.peak(static_cast<MemCategory>(c)));
  p[PEAK_TOTAL] = static_cast<double>(m.total_peak());
  p[STOP_SIGNAL] = stop_signal_received();
  p[RSS_GROWTH] = proc_status_bytes("VmHWM") - rss_at_start;
  p[DEVICE_RESERVED] = static_cast<double>(device.peak_reserved_bytes());
  p[HELD] = static_cast<double>(device.peak_live_bytes() + comm_buffers);
  return p;
}

nlohmann::ordered_json step_record(int step, const StepMaxima& p, double loss, double lr, double grad_norm,
                                   double tokens_per_s, double mfu, double seconds, double planned_bytes) {
  auto finite_or_null = [](double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(); };
  auto bytes = [](double x) { return static_cast<int64_t>(x); };
  nlohmann::ordered_json j;
  j["kind"] = "step";
  j["step"] = step;
  j["loss"] = finite_or_null(loss);
  j["lr"] = lr;
  j["grad_norm"] = finite_or_null(grad_norm);
  j["tokens_per_s"] = tokens_per_s;
  j["mfu"] = mfu;
  j["step_seconds"] = seconds;
  // planned: the plan's peak; held: what the device counted at allocation (the two are equal on the CPU).
  j["peak_mem_bytes"] = bytes(planned_bytes);
  j["planned_mem_bytes"] = bytes(planned_bytes);
  j["held_mem_bytes"] = bytes(p[HELD]);
  nlohmann::ordered_json categories;
  for (int c = 0; c < MEM_CATEGORY_COUNT; c++) categories[mem_category_name(static_cast<MemCategory>(c))] = bytes(p[c]);
  j["peak_mem"] = categories;
  j["rss_growth_bytes"] = bytes(p[RSS_GROWTH]);
  j["comm_bytes"] = bytes(p[COMM_BYTES]);
  j["device_reserved_bytes"] = bytes(p[DEVICE_RESERVED]);
  j["host_syncs"] = bytes(p[HOST_SYNCS]);
  nlohmann::ordered_json phases;  // the slowest rank's seconds per phase of the step
  for (int phase = 0; phase < PHASE_COUNT; phase++)
    phases[step_phase_name(static_cast<StepPhase>(phase))] = p[PHASE_SECONDS + phase];
  j["phase_seconds"] = phases;
  return j;
}

}  // namespace shardtrain
