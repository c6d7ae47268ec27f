// Turns a collective that does not finish within the timeout (fsdp.comm_timeout for train,
// --comm-timeout for the other commands) into an abort with a message.
//
// The communicating thread marks the start and end of every blocking collective (Scope); a
// background thread checks the mark every few milliseconds. A rank stuck in compute is not
// itself flagged: its peers, waiting for it inside a collective, are, and their MPI_Abort takes
// the whole job down. timeout <= 0 disables the watchdog.
//
// Scope the collectives, not whole phases: a checkpoint save is many collectives, each timed on
// its own, so a long healthy save never trips the timeout while a stalled collective in it does.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>

#include "core/error.hpp"

namespace shardtrain {

class Watchdog {
 public:
  // Runs on the monitor thread when the collective `what` has waited `waited` seconds, past the
  // timeout. The default prints "<label> error: collective ... did not complete within <option>=T s"
  // and MPI_Aborts; outside MPI_Init..MPI_Finalize, where MPI_Abort cannot be called, it exits the
  // process, which the launcher turns into the end of the job.
  using OnTimeout = std::function<void(const char* what, double waited)>;

  // `option`: the setting that chose the timeout, named in the message.
  explicit Watchdog(double timeout_seconds, std::string option = "fsdp.comm_timeout", std::string label = rank_label(),
                    OnTimeout on_timeout = nullptr);
  ~Watchdog();
  Watchdog(const Watchdog&) = delete;
  Watchdog& operator=(const Watchdog&) = delete;

  double timeout_seconds() const { return timeout_seconds_; }

  // The line the default OnTimeout prints: "<label> error: collective <what> did not complete within
  // <option>=T s: ...", naming the option to raise.
  static std::string message(const std::string& label, const char* what, const std::string& option, double seconds);

  // Marks one blocking collective for its lifetime; `what` must outlive the scope (a literal).
  // Only the communicating thread opens scopes. Scopes nest: when an inner one ends, the outer
  // one is current again with its clock restarted (the inner collective was progress).
  class Scope {
   public:
    Scope(Watchdog* dog, const char* what);
    ~Scope();
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Watchdog* dog_;
    const char* outer_what_ = nullptr;
  };

 private:
  // Makes `what` (nullptr: none) the current collective, started now.
  void mark(const char* what);
  void loop();

  double timeout_seconds_;
  std::string option_;
  std::string label_;
  OnTimeout on_timeout_;
  // The mark, published like a seqlock: generation_ is odd while the communicating thread
  // rewrites what_/since_, and changes with every mark, so the monitor can tell that the pair it
  // read belongs to one scope that was still open when it looked at the clock.
  std::atomic<uint64_t> generation_{0};
  std::atomic<const char*> what_{nullptr};
  std::atomic<double> since_{0.0};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace shardtrain
