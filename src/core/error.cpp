// The fatal paths: print one line that says which rank, where and why, then MPI_Abort so that no
// rank is left waiting in a collective. Never exit(): the other ranks would hang.
#include "core/error.hpp"

#include <mpi.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

namespace shardtrain {

std::string vstrprintf(const char* fmt, va_list args) {
  va_list copy;
  va_copy(copy, args);
  int n = std::vsnprintf(nullptr, 0, fmt, copy);
  va_end(copy);
  std::vector<char> buf(n > 0 ? n + 1 : 1);
  std::vsnprintf(buf.data(), buf.size(), fmt, args);
  return std::string(buf.data());
}

std::string strprintf(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::string s = vstrprintf(fmt, args);
  va_end(args);
  return s;
}

void world_position(int* rank, int* world) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  *rank = 0, *world = 1;
  if (initialized && !finalized) {
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, world);
    return;
  }
  // Before MPI_Init (a start-up that hangs) or after MPI_Finalize: what the launcher told the process.
  for (const char* name : {"OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID"})
    if (const char* value = std::getenv(name)) {
      *rank = std::atoi(value);
      break;
    }
  for (const char* name : {"OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"})
    if (const char* value = std::getenv(name)) {
      *world = std::atoi(value);
      break;
    }
}

std::string rank_label() {
  int rank = 0, world = 1;
  world_position(&rank, &world);
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  return strprintf("[rank %d/%d %s]", rank, world, host);
}

[[noreturn]] static void abort_all(int code) {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  std::fflush(stdout);
  std::fflush(stderr);
  if (initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);
}

void fatal_input(const std::string& message) {
  std::fprintf(stderr, "%s error: %s\n", rank_label().c_str(), message.c_str());
  abort_all(EXIT_CODE_BAD_INPUT);
}

void fatal_internal(const char* file, int line, const char* func, const std::string& message) {
  std::fprintf(stderr, "%s internal error in %s (%s:%d): %s\n", rank_label().c_str(), func, file, line,
               message.c_str());
  abort_all(EXIT_CODE_INTERNAL);
}

void fatal_mpi(const char* file, int line, const char* func, const char* statement, int code) {
  char text[MPI_MAX_ERROR_STRING] = "";
  int len = 0;
  MPI_Error_string(code, text, &len);
  fatal_internal(file, line, func, strprintf("%s returned %d (%s)", statement, code, text));
}

void throw_input_error(char kind, const std::string& message) {
  switch (kind) {
    case 'U': throw UsageError(message);
    case 'D': throw DataError(message);
    case 'C': throw CheckpointError(message);
    default: throw InputError(message);
  }
}

}  // namespace shardtrain
