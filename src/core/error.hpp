// Errors and checks shared by every layer.
//
// Bad input (options, config, data, checkpoints) is reported by throwing a typed InputError;
// app/main.cpp turns it into one line and exit code 2 on every rank. A broken internal invariant
// is SHARD_CHECK, always compiled in, which prints where and why and aborts every rank (exit 1).
// Exit codes are the product's contract (README): 0 done, 1 internal, 2 bad input, 3 signalled.
#pragma once

#include <cstdarg>
#include <stdexcept>
#include <string>

namespace shardtrain {

enum ExitCode : int {
  EXIT_CODE_OK = 0,
  EXIT_CODE_INTERNAL = 1,
  EXIT_CODE_BAD_INPUT = 2,
  EXIT_CODE_SIGNALLED = 3,
};

// Base of every user-correctable error: the message names the option/file and the fix. kind()
// names the type, so that an error agreed between ranks (Runtime::agree_on) is thrown again as the
// same type on every rank (a UsageError stays fatal where a CheckpointError may be skipped).
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
  virtual char kind() const { return 'I'; }
};
struct UsageError : InputError {
  using InputError::InputError;
  char kind() const override { return 'U'; }
};
struct DataError : InputError {
  using InputError::InputError;
  char kind() const override { return 'D'; }
};
struct CheckpointError : InputError {
  using InputError::InputError;
  char kind() const override { return 'C'; }
};
// Throws the InputError of that kind() with the message.
[[noreturn]] void throw_input_error(char kind, const std::string& message);

// printf into a std::string.
std::string strprintf(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string vstrprintf(const char* fmt, va_list args);

// This process's rank and the number of ranks in MPI_COMM_WORLD; before MPI_Init and after
// MPI_Finalize, what the launcher's environment says (Open MPI, PMIx, Slurm), else 0 of 1.
void world_position(int* rank, int* world);
// "[rank r/N host]": how every message of one rank names it (world_position's numbers).
std::string rank_label();

// Bad input that only this rank can see, where agreeing is impossible (e.g. GPU memory running out
// in the middle of a step): prints "[rank r/N host] error: message" and aborts every rank, exit 2.
[[noreturn]] void fatal_input(const std::string& message);

// Prints "[rank r/N host] internal error in func (file:line): message" and aborts all ranks.
[[noreturn]] void fatal_internal(const char* file, int line, const char* func, const std::string& message);

}  // namespace shardtrain

#define SHARD_CHECK(cond, ...)                                                                     \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      ::shardtrain::fatal_internal(__FILE__, __LINE__, __func__,                                   \
                                   "check `" #cond "` failed: " + ::shardtrain::strprintf(__VA_ARGS__)); \
  } while (0)

// Evaluates an MPI call once; on failure names the statement and MPI's own error string.
#define MPI_CHECK(call)                                                                            \
  do {                                                                                             \
    int mpi_check_rc_ = (call);                                                                    \
    if (mpi_check_rc_ != MPI_SUCCESS) ::shardtrain::fatal_mpi(__FILE__, __LINE__, __func__, #call, mpi_check_rc_); \
  } while (0)

namespace shardtrain {
[[noreturn]] void fatal_mpi(const char* file, int line, const char* func, const char* statement, int code);
}
