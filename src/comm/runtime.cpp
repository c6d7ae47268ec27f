// MPI bootstrap and the collective error agreement. See runtime.hpp.
#include "comm/runtime.hpp"

#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <vector>

#include "core/error.hpp"

namespace shardtrain {

Runtime::Runtime(int* argc, char*** argv) {
  int provided = 0;
  // MULTIPLE because the watchdog thread may call MPI_Abort while the main thread sits in a
  // collective; all communication itself stays on the main thread.
  MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
  // Errors come back as codes so MPI_CHECK can name the failing call before aborting.
  MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN));
  MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_));
  MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_));
  MPI_Comm node = MPI_COMM_NULL;
  MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank_, MPI_INFO_NULL, &node));
  MPI_CHECK(MPI_Comm_rank(node, &local_rank_));
  MPI_CHECK(MPI_Comm_size(node, &local_size_));
  MPI_CHECK(MPI_Comm_free(&node));
  char name[256] = "";
  gethostname(name, sizeof name - 1);
  host_ = name;
}

Runtime::~Runtime() {
  std::fflush(stdout);
  MPI_Finalize();
}

std::string agreed_error(const std::string& local_error, MPI_Comm comm) {
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

void Runtime::agree(const std::string& local_error) const {
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
