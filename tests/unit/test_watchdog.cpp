// The watchdog times collectives, not phases: a long operation made of many short collectives is
// never flagged, a stalled one is, and the mark read across a scope boundary is never stale.
#include <gtest/gtest.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/runtime.hpp"
#include "comm/watchdog.hpp"

using namespace shardtrain;

namespace {

constexpr double kTimeout = 0.2;  // seconds; the monitor looks every 20 ms

void sleep_seconds(double s) { std::this_thread::sleep_for(std::chrono::duration<double>(s)); }

// Records the timeouts instead of aborting.
struct Timeouts {
  std::mutex mutex;
  std::vector<std::string> what;
  std::vector<double> waited;
  Watchdog::OnTimeout handler() {
    return [this](const char* w, double seconds) {
      std::lock_guard<std::mutex> lock(mutex);
      what.push_back(w);
      waited.push_back(seconds);
    };
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mutex);
    return what.size();
  }
};

}  // namespace

// A checkpoint save: an outer scope over many collectives that each finish in time, lasting
// several timeouts in all. (The watchdog that restored the outer scope's start time aborted it.)
TEST(Watchdog, LongOperationOfShortCollectivesIsNotAborted) {
  Timeouts timeouts;
  Watchdog dog(kTimeout, "fsdp.comm_timeout", "[test]", timeouts.handler());
  const auto start = std::chrono::steady_clock::now();
  {
    Watchdog::Scope save(&dog, "checkpoint save");
    for (int i = 0; i < 20; i++) {
      Watchdog::Scope collective(&dog, "all_reduce(test)");
      sleep_seconds(kTimeout / 4);
    }
  }
  sleep_seconds(3 * kTimeout);  // idle: nothing is timed
  EXPECT_GT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5 * kTimeout);
  EXPECT_EQ(timeouts.count(), 0u) << timeouts.what.front();
}

TEST(Watchdog, StalledCollectiveIsReportedOnce) {
  Timeouts timeouts;
  Watchdog dog(kTimeout, "fsdp.comm_timeout", "[test]", timeouts.handler());
  {
    Watchdog::Scope quick(&dog, "broadcast(test)");
  }
  {
    Watchdog::Scope stalled(&dog, "all_gather(test)");
    sleep_seconds(4 * kTimeout);
  }
  ASSERT_EQ(timeouts.count(), 1u);
  EXPECT_EQ(timeouts.what[0], "all_gather(test)");
  EXPECT_GT(timeouts.waited[0], kTimeout);
}

// Progress inside an outer scope restarts its clock; a stall after it is still caught, by name.
TEST(Watchdog, StallInsideAnOuterScopeAfterProgressIsReported) {
  Timeouts timeouts;
  Watchdog dog(kTimeout, "fsdp.comm_timeout", "[test]", timeouts.handler());
  {
    Watchdog::Scope outer(&dog, "checkpoint save: H5Fclose");
    for (int i = 0; i < 5; i++) Watchdog::Scope collective(&dog, "all_reduce(test)");
    sleep_seconds(4 * kTimeout);
  }
  ASSERT_EQ(timeouts.count(), 1u);
  EXPECT_EQ(timeouts.what[0], "checkpoint save: H5Fclose");
}

// Scopes opened and closed as fast as possible, with one name: the monitor must never pair the
// name with a start time that belongs to no open scope.
TEST(Watchdog, BackToBackScopesAreNeverMistakenForAStall) {
  Timeouts timeouts;
  Watchdog dog(0.02, "fsdp.comm_timeout", "[test]", timeouts.handler());
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(600);
  while (std::chrono::steady_clock::now() < end) {
    Watchdog::Scope a(&dog, "all_reduce(test)");
  }
  EXPECT_EQ(timeouts.count(), 0u);
}

TEST(Runtime, ThreadLevelBelowMultipleIsRefusedByName) {
  EXPECT_EQ(mpi_thread_level_error(MPI_THREAD_MULTIPLE), "");
  const std::pair<int, const char*> levels[] = {
      {MPI_THREAD_SINGLE, "MPI_THREAD_SINGLE"}, {MPI_THREAD_FUNNELED, "MPI_THREAD_FUNNELED"},
      {MPI_THREAD_SERIALIZED, "MPI_THREAD_SERIALIZED"}};
  for (const auto& [level, name] : levels) {
    const std::string error = mpi_thread_level_error(level);
    EXPECT_NE(error.find(std::string("gives thread level ") + name), std::string::npos) << error;
    EXPECT_NE(error.find("needs MPI_THREAD_MULTIPLE"), std::string::npos) << error;
  }
}

// The start-up timeout is read from the command line before MPI_Init, leniently: what the option
// parser would refuse later leaves the default.
TEST(StartupTimeout, ReadsTheCommandsOwnOption) {
  const double kDefault = CollectiveTimeout::DEFAULT_SECONDS;
  struct Case {
    std::vector<std::string> args;
    double seconds;
    std::string option;
  } cases[] = {
      {{"train", "--fsdp.comm_timeout=7"}, 7, "fsdp.comm_timeout"},
      {{"train", "--fsdp.comm_timeout", "7.5"}, 7.5, "fsdp.comm_timeout"},
      {{"train", "--comm-timeout=7"}, kDefault, "fsdp.comm_timeout"},  // not train's option
      {{"convert", "--comm-timeout", "0"}, 0, "--comm-timeout"},
      {{"data", "encode", "--comm-timeout=12"}, 12, "--comm-timeout"},
      {{"export", "--comm-timeout=-1"}, kDefault, "--comm-timeout"},
      {{"generate", "--comm-timeout=abc"}, kDefault, "--comm-timeout"},
      {{"generate", "--comm-timeout"}, kDefault, "--comm-timeout"},  // no value
      {{"plan", "--comm-timeout=5"}, kDefault, ""},                  // plan has no such option
      {{}, kDefault, ""},
  };
  for (const Case& c : cases) {
    const CollectiveTimeout t = startup_timeout(c.args);
    const std::string line = c.args.empty() ? "(none)" : c.args.back();
    EXPECT_EQ(t.seconds, c.seconds) << line;
    EXPECT_EQ(t.option, c.option) << line;
  }
}
