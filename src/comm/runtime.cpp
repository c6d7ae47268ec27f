// MPI bootstrap and the collective error agreement. See runtime.hpp.
#include "comm/runtime.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <vector>

#include "comm/comm.hpp"
#include "comm/watchdog.hpp"
#include "core/error.hpp"

namespace shardtrain {

std::string mpi_thread_level_error(int provided) {
  if (provided >= MPI_THREAD_MULTIPLE) return "";
  const char* names[] = {"MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED"};
  const bool known = provided >= MPI_THREAD_SINGLE && provided <= MPI_THREAD_SERIALIZED;
  return strprintf("the MPI library gives thread level %s, and shardtrain needs MPI_THREAD_MULTIPLE (its watchdog "
                   "thread aborts a stalled collective while the main thread is inside it); use an MPI built with "
                   "thread support (Open MPI: the default since 3.0; MPICH: --enable-threads=multiple)",
                   known ? names[provided - MPI_THREAD_SINGLE] : std::to_string(provided).c_str());
}

Runtime::Runtime(int* argc, char*** argv) {
  int provided = 0;
  // MULTIPLE because the watchdog thread may call MPI_Abort while the main thread sits in a
  // collective; all communication itself stays on the main thread.
  MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
  const std::string thread_error = mpi_thread_level_error(provided);
  if (!thread_error.empty()) fatal_input(thread_error);  // every rank gets the same level
  // Errors come back as codes so MPI_CHECK can name the failing call before aborting.
  MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_));
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node_));
  MPI_CHECK(MPI_Comm_rank(node_, &local_rank_));
  MPI_CHECK(MPI_Comm_size(node_, &local_size_));
  char name[256] = "";
  gethostname(name, sizeof name - 1);
  host_ = name;
  set_collective_timeout(DEFAULT_COLLECTIVE_TIMEOUT);
}

Runtime::~Runtime() {
  std::fflush(stdout);
  for (MPI_Comm& comm : splits_) MPI_Comm_free(&comm);
  MPI_Comm_free(&node_);
  {
    // A peer that never reaches MPI_Finalize (stuck, or gone without mpirun noticing) would hold
    // every other rank here forever.
    Watchdog::Scope scope(watchdog_.get(), "MPI_Finalize");
    MPI_Finalize();
  }
  watchdog_.reset();
}

void Runtime::set_collective_timeout(double seconds) {
  watchdog_.reset();  // its monitor thread ends before the next one starts
  watchdog_ = std::make_unique<Watchdog>(seconds);
}

MPI_Comm Runtime::split_world(int color, int key) const {
  MPI_Comm comm;
  Watchdog::Scope scope(watchdog_.get(), "MPI_Comm_split");
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm));
  splits_.push_back(comm);
  return comm;
}

std::vector<std::string> Runtime::node_all_gather(const std::string& mine) const {
  Watchdog::Scope scope(watchdog_.get(), "node_all_gather");
  int length = static_cast<int>(mine.size());
  std::vector<int> lengths(local_size_), offsets(local_size_);
  MPI_CHECK(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, node_));
  int total = 0;
  for (int r = 0; r < local_size_; r++) offsets[r] = total, total += lengths[r];
  std::vector<char> all(std::max(total, 1));
  MPI_CHECK(MPI_Allgatherv(mine.data(), length, MPI_CHAR, all.data(), lengths.data(), offsets.data(), MPI_CHAR, node_));
  std::vector<std::string> strings;
  for (int r = 0; r < local_size_; r++) strings.emplace_back(all.data() + offsets[r], lengths[r]);
  return strings;
}

// The agreement on MPI directly: the Runtime has no Comm of its own.
static std::string agreed_error(const std::string& local_error, MPI_Comm comm) {
  int rank = 0, size = 1;
  MPI_CHECK(MPI_Comm_rank(comm, &rank));
  MPI_CHECK(MPI_Comm_size(comm, &size));
  int mine = local_error.empty() ? size : rank;
  int first_failing = size;
  MPI_CHECK(MPI_Allreduce(&mine, &first_failing, 1, MPI_INT, MPI_MIN, comm));
  if (first_failing == size) return "";
  int length = rank == first_failing ? static_cast<int>(local_error.size()) : 0;
  MPI_CHECK(MPI_Bcast(&length, 1, MPI_INT, first_failing, comm));
  std::vector<char> text(local_error.begin(), local_error.end());
  text.resize(length);
  MPI_CHECK(MPI_Bcast(text.data(), length, MPI_CHAR, first_failing, comm));
  return std::string(text.begin(), text.end());
}

std::string agreed_error(const std::string& local_error, Comm& comm) {
  // The lowest failing rank r as the largest size - r (0: none failed); doubles hold it exactly.
  double first = local_error.empty() ? 0 : comm.size() - comm.rank();
  comm.all_reduce_max(Span<double>(&first, 1), "all_reduce(agree on errors)");
  if (first == 0) return "";
  const int root = comm.size() - static_cast<int>(first);
  uint64_t length = comm.rank() == root ? local_error.size() : 0;
  comm.broadcast(Span<char>(reinterpret_cast<char*>(&length), sizeof length), root, "broadcast(error length)");
  std::string text = comm.rank() == root ? local_error : std::string(length, '\0');
  comm.broadcast(Span<char>(text.data(), text.size()), root, "broadcast(error)");
  return text;
}

void Runtime::agree(const std::string& local_error) const {
  Watchdog::Scope scope(watchdog_.get(), "agreement on the inputs");
  std::string error = agreed_error(local_error, MPI_COMM_WORLD);
  if (!error.empty()) throw InputError(error);
}

// Rank 0 prints one line to `stream`, after `prefix`; other ranks print nothing.
static void print_line(int rank, std::FILE* stream, const char* prefix, const char* fmt, va_list args) {
  if (rank != 0) return;
  std::string line = vstrprintf(fmt, args);
  std::fprintf(stream, "%s%s\n", prefix, line.c_str());
  std::fflush(stream);
}

void Runtime::info(const char* fmt, ...) const {
  va_list args;
  va_start(args, fmt);
  print_line(rank_, stdout, "", fmt, args);
  va_end(args);
}

void Runtime::warn(const char* fmt, ...) const {
  va_list args;
  va_start(args, fmt);
  print_line(rank_, stderr, "warning: ", fmt, args);
  va_end(args);
}

}  // namespace shardtrain
