// MPI bootstrap and the collective error agreement. See runtime.hpp.
#include "comm/runtime.hpp"

#include <stdlib.h>
#include <sys/time.h>
#include <unistd.h>

#include <csignal>
#include <cmath>
#include <algorithm>
#include <cstdarg>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "comm/comm.hpp"
#include "comm/watchdog.hpp"
#include "core/clock.hpp"
#include "core/error.hpp"

namespace shardtrain {
namespace {

// MPI_Init is timed by an interval timer, not by the watchdog's thread, so that no thread of ours
// runs while the MPI library initialises (Open MPI patches memory functions in place then). When
// it fires, the handler writes the prepared line and ends the process, which the launcher turns
// into the end of the job (MPI_Abort needs an initialised MPI).
char g_startup_message[1024];

extern "C" void startup_timed_out(int) {
  const ssize_t written = write(STDERR_FILENO, g_startup_message, std::strlen(g_startup_message));
  (void)written;
  _exit(EXIT_CODE_INTERNAL);
}

class StartupAlarm {
 public:
  StartupAlarm(double seconds, const std::string& message) : armed_(seconds > 0) {
    if (!armed_) return;
    std::snprintf(g_startup_message, sizeof g_startup_message, "%s\n", message.c_str());
    struct sigaction action {};
    action.sa_handler = startup_timed_out;
    sigemptyset(&action.sa_mask);
    sigaction(SIGALRM, &action, &previous_);
    itimerval timer{};
    timer.it_value.tv_sec = static_cast<time_t>(seconds);
    timer.it_value.tv_usec = std::max<suseconds_t>(1, static_cast<suseconds_t>((seconds - std::floor(seconds)) * 1e6));
    setitimer(ITIMER_REAL, &timer, nullptr);
  }
  ~StartupAlarm() {
    if (!armed_) return;
    itimerval off{};
    setitimer(ITIMER_REAL, &off, nullptr);
    sigaction(SIGALRM, &previous_, nullptr);
  }
  StartupAlarm(const StartupAlarm&) = delete;
  StartupAlarm& operator=(const StartupAlarm&) = delete;

 private:
  bool armed_;
  struct sigaction previous_ {};
};

}  // namespace

std::string mpi_thread_level_error(int provided) {
  if (provided >= MPI_THREAD_MULTIPLE) return "";
  const char* names[] = {"MPI_THREAD_SINGLE", "MPI_THREAD_FUNNELED", "MPI_THREAD_SERIALIZED"};
  const bool known = provided >= MPI_THREAD_SINGLE && provided <= MPI_THREAD_SERIALIZED;
  return strprintf("the MPI library gives thread level %s, and shardtrain needs MPI_THREAD_MULTIPLE (its watchdog "
                   "thread aborts a stalled collective while the main thread is inside it); use an MPI built with "
                   "thread support (Open MPI: the default since 3.0; MPICH: --enable-threads=multiple)",
                   known ? names[provided - MPI_THREAD_SINGLE] : std::to_string(provided).c_str());
}

CollectiveTimeout startup_timeout(const std::vector<std::string>& args) {
  CollectiveTimeout timeout;
  const bool train = !args.empty() && args[0] == "train";
  const char* commands_with_the_option[] = {"generate", "eval", "sample", "convert", "export", "data"};
  bool has_option = train;
  for (const char* command : commands_with_the_option) has_option = has_option || (!args.empty() && args[0] == command);
  timeout.option = train ? "fsdp.comm_timeout" : has_option ? "--comm-timeout" : "";
  const std::string flag = train ? "--fsdp.comm_timeout" : "--comm-timeout";
  for (size_t i = 1; has_option && i < args.size(); i++) {
    std::string value;
    if (args[i] == flag && i + 1 < args.size())
      value = args[i + 1];
    else if (args[i].rfind(flag + "=", 0) == 0)
      value = args[i].substr(flag.size() + 1);
    else
      continue;
    char* end = nullptr;
    const double seconds = std::strtod(value.c_str(), &end);
    if (!value.empty() && *end == '\0' && seconds >= 0 && seconds <= 1e9) timeout.seconds = seconds;
  }
  return timeout;
}

Runtime::Runtime(int* argc, char*** argv, const CollectiveTimeout& timeout) : timeout_(timeout) {
  // Open MPI's ompio (HDF5's MPI_File_open) queries the `lockedfile` shared-file-pointer component
  // at every open, which builds a name from the file's path in a 256-byte buffer: a checkpoint
  // path of about 230 bytes or more aborted every rank (glibc's "buffer overflow detected") after
  // training, before anything was saved. Nothing of ours uses shared file pointers, so that
  // component is left out unless the user chose the components (Open MPI issue 13565, fixed in
  // 5.0.x). Other MPIs ignore the variable.
  setenv("OMPI_MCA_sharedfp", "^lockedfile", /*overwrite=*/0);
  int provided = 0;
  // MPI_Init waits for every rank of the job: one stopped before it would hang the others.
  debug_stall("init");
  {
    StartupAlarm alarm(timeout_.seconds, Watchdog::message(rank_label(), "MPI_Init", timeout_.option, timeout_.seconds));
    // MULTIPLE because the watchdog thread may call MPI_Abort while the main thread sits in a
    // collective, and on_root's heartbeat thread sends while the main thread works.
    MPI_CHECK(MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &provided));
  }
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
  set_collective_timeout(timeout_);  // labelled with the rank MPI gave
  MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &heartbeat_));
  gather_layout();
}

// Every rank learns every rank's node: a node is named by its lowest rank (node-local rank 0, as
// the split is keyed by rank), and only those leaders contribute their host name.
void Runtime::gather_layout() {
  Watchdog::Scope scope(watchdog_.get(), "gather the node layout");
  int leader = rank_;
  MPI_CHECK(MPI_Bcast(&leader, 1, MPI_INT, 0, node_));
  std::vector<int> leaders(world_);
  MPI_CHECK(MPI_Allgather(&leader, 1, MPI_INT, leaders.data(), 1, MPI_INT, MPI_COMM_WORLD));
  int length = local_rank_ == 0 ? static_cast<int>(host_.size()) : 0;
  std::vector<int> lengths(world_), offsets(world_);
  MPI_CHECK(MPI_Allgather(&length, 1, MPI_INT, lengths.data(), 1, MPI_INT, MPI_COMM_WORLD));
  int total = 0;
  for (int r = 0; r < world_; r++) offsets[r] = total, total += lengths[r];
  std::vector<char> names(std::max(total, 1));
  MPI_CHECK(MPI_Allgatherv(host_.data(), length, MPI_CHAR, names.data(), lengths.data(), offsets.data(), MPI_CHAR,
                           MPI_COMM_WORLD));
  std::vector<int> node_of_leader(world_, -1);
  layout_.node_of_rank.assign(world_, 0);
  layout_.host_of_node.clear();
  for (int r = 0; r < world_; r++) {
    const int l = leaders[r];
    if (node_of_leader[l] < 0) {  // leaders come in rank order: nodes are numbered by their lowest rank
      node_of_leader[l] = layout_.nodes();
      layout_.host_of_node.emplace_back(names.data() + offsets[l], lengths[l]);
    }
    layout_.node_of_rank[r] = node_of_leader[l];
  }
}

std::vector<int> NodeLayout::ranks_on(int node) const {
  std::vector<int> found;
  for (int r = 0; r < ranks(); r++)
    if (node_of_rank[r] == node) found.push_back(r);
  return found;
}

GroupPlan plan_groups(const NodeLayout& layout, int group_size) {
  GroupPlan plan;
  const int world = layout.ranks();
  std::vector<std::vector<int>> nodes(layout.nodes());
  for (int r = 0; r < world; r++) nodes[layout.node_of_rank[r]].push_back(r);
  int size = group_size;
  if (size == 0) {
    bool equal = true;
    for (const auto& ranks : nodes) equal = equal && ranks.size() == nodes[0].size();
    if (!equal) {
      std::string counts;
      for (size_t n = 0; n < nodes.size() && n < 8; n++)
        counts += strprintf("%s%s %zu rank%s", n ? ", " : "", layout.host_of_node[n].c_str(), nodes[n].size(),
                            nodes[n].size() == 1 ? "" : "s");
      if (nodes.size() > 8) counts += strprintf(", ... (%zu nodes)", nodes.size());
      plan.error = strprintf(
          "HYBRID_SHARD with fsdp.shard_group_size=0 shards within each node, and the nodes have different rank "
          "counts (%s); start the same number of ranks on every node (srun --ntasks-per-node=N, mpirun --map-by "
          "ppr:N:node) or set fsdp.shard_group_size to a divisor of the %d ranks",
          counts.c_str(), world);
      return plan;
    }
    size = static_cast<int>(nodes[0].size());
  }
  if (size < 1 || world % size != 0) {
    plan.error = strprintf("shard groups of %d ranks do not divide the %d ranks; set fsdp.shard_group_size to a divisor "
                           "of the rank count", size, world);
    return plan;
  }
  plan.group_size = size;
  plan.shard_of_rank.assign(world, 0);
  plan.replica_of_rank.assign(world, 0);
  int position = 0;  // in node order
  for (const auto& ranks : nodes)
    for (int r : ranks) plan.shard_of_rank[r] = position / size, plan.replica_of_rank[r] = position % size, position++;
  return plan;
}

namespace {

// "{0 1 2 5}", runs of three or more as "0-2".
std::string rank_set(const std::vector<int>& ranks) {
  std::string text = "{";
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) j++;
    text += (i ? " " : "") + (j >= i + 2 ? strprintf("%d-%d", ranks[i], ranks[j]) : std::to_string(ranks[i]));
    if (j == i + 1) text += " " + std::to_string(ranks[j]);
    i = j + 1;
  }
  return text + "}";
}

// The members of each group, by group number (ascending ranks).
std::vector<std::vector<int>> members(const std::vector<int>& group_of_rank) {
  std::vector<std::vector<int>> groups;
  for (int r = 0; r < static_cast<int>(group_of_rank.size()); r++) {
    if (group_of_rank[r] >= static_cast<int>(groups.size())) groups.resize(group_of_rank[r] + 1);
    groups[group_of_rank[r]].push_back(r);
  }
  return groups;
}

// "h1" or "h1+h2": the hosts of `ranks`, in node order.
std::string hosts_of(const NodeLayout& layout, const std::vector<int>& ranks) {
  std::vector<int> nodes;
  for (int r : ranks) nodes.push_back(layout.node_of_rank[r]);
  std::sort(nodes.begin(), nodes.end());
  nodes.erase(std::unique(nodes.begin(), nodes.end()), nodes.end());
  std::string text;
  for (int n : nodes) text += (text.empty() ? "" : "+") + layout.host_of_node[n];
  return text;
}

constexpr size_t MAX_LISTED_GROUPS = 8;

}  // namespace

std::string GroupPlan::describe(const NodeLayout& layout) const {
  const auto shards = members(shard_of_rank), replicas = members(replica_of_rank);
  std::string text = strprintf("%zu shard group%s of %d rank%s: ", shards.size(), shards.size() == 1 ? "" : "s",
                               group_size, group_size == 1 ? "" : "s");
  for (size_t g = 0; g < shards.size() && g < MAX_LISTED_GROUPS; g++)
    text += (g ? ", " : "") + rank_set(shards[g]) + " on " + hosts_of(layout, shards[g]);
  if (shards.size() > MAX_LISTED_GROUPS) text += strprintf(", ... (%zu more)", shards.size() - MAX_LISTED_GROUPS);
  if (shards.size() == 1) return text + " | no replicas";
  text += strprintf(" | %zu replica group%s:", replicas.size(), replicas.size() == 1 ? "" : "s");
  for (size_t g = 0; g < replicas.size() && g < MAX_LISTED_GROUPS; g++) text += " " + rank_set(replicas[g]);
  if (replicas.size() > MAX_LISTED_GROUPS) text += strprintf(" ... (%zu more)", replicas.size() - MAX_LISTED_GROUPS);
  return text;
}

std::vector<std::string> GroupPlan::straddling(const NodeLayout& layout) const {
  std::vector<std::string> found;
  std::vector<int> per_node(layout.nodes(), 0);
  for (int node : layout.node_of_rank) per_node[node]++;
  for (const auto& ranks : members(shard_of_rank)) {
    std::vector<int> here(layout.nodes(), 0);
    for (int r : ranks) here[layout.node_of_rank[r]]++;
    int nodes = 0;
    bool partial = false;
    for (int n = 0; n < layout.nodes(); n++)
      if (here[n]) nodes++, partial = partial || here[n] < per_node[n];
    if (nodes > 1 && partial) found.push_back(rank_set(ranks) + " on " + hosts_of(layout, ranks));
  }
  return found;
}

GroupPlan Runtime::checked_plan(int group_size) const {
  GroupPlan plan = plan_groups(layout_, group_size);
  // Every rank plans from the same layout, so every rank throws the same error here, before any split.
  if (!plan.error.empty()) throw UsageError(plan.error);
  return plan;
}

MPI_Comm Runtime::split(int color, int key, const char* what) const {
  MPI_Comm comm;
  Watchdog::Scope scope(watchdog_.get(), what);
  MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm));
  splits_.push_back(comm);
  return comm;
}

MPI_Comm Runtime::shard_group_comm(int group_size) const {
  const GroupPlan plan = checked_plan(group_size);
  if (layout_.nodes() > 1 || (plan.group_size > 1 && plan.group_size < world_))
    info("groups: %s", plan.describe(layout_).c_str());
  // A group over whole nodes is a choice; one over part of a node and part of another is a layout
  // that does not fit the group size, and its all-gathers cross the network needlessly.
  for (const std::string& group : plan.straddling(layout_))
    warn("shard group %s holds part of a host's ranks with another host's: its all-gathers and reduce-scatters "
         "cross the network; start the same number of ranks on every node, a multiple of fsdp.shard_group_size=%d",
         group.c_str(), plan.group_size);
  return split(plan.shard_of_rank[rank_], rank_, "MPI_Comm_split(shard groups)");
}

MPI_Comm Runtime::replica_group_comm(int group_size) const {
  const GroupPlan plan = checked_plan(group_size);
  return split(plan.replica_of_rank[rank_], rank_, "MPI_Comm_split(replica groups)");
}

Runtime::~Runtime() {
  std::fflush(stdout);
  for (MPI_Comm& comm : splits_) MPI_Comm_free(&comm);
  MPI_Comm_free(&node_);
  MPI_Comm_free(&heartbeat_);
  debug_stall("finalize");
  {
    // A peer that never reaches MPI_Finalize (stuck, or gone without mpirun noticing) would hold
    // every other rank here forever.
    Watchdog::Scope scope(watchdog_.get(), "MPI_Finalize");
    MPI_Finalize();
  }
  watchdog_.reset();
}

void Runtime::set_collective_timeout(const CollectiveTimeout& timeout) {
  timeout_ = timeout;
  watchdog_.reset();  // its monitor thread ends before the next one starts
  watchdog_ = std::make_unique<Watchdog>(timeout_.seconds, timeout_.option);
}

void Runtime::debug_stall(const char* point) {
  const char* spec = std::getenv("SHARDTRAIN_DEBUG_STALL");
  if (!spec) return;
  int stall_rank = -1;
  char where[32] = "", what[32] = "";
  if (std::sscanf(spec, "%d:%31[^:]:%31s", &stall_rank, where, what) != 3 || std::strcmp(where, point) != 0) return;
  int rank = 0, world = 1;
  world_position(&rank, &world);
  if (rank != stall_rank) return;
  if (std::strcmp(what, "segv") == 0) {
    void (*volatile null_function)() = nullptr;
    null_function();  // the crash reporter's test: a jump to address 0, as the one seen in a cluster test
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(std::strtod(what, nullptr)));
}

namespace {
constexpr int TAG_HEARTBEAT = 1, TAG_WORK_DONE = 2;
// Often enough that a waiting rank hears several beats within any timeout worth setting.
double heartbeat_interval(double timeout) { return timeout > 0 ? std::min(1.0, timeout / 4) : 1.0; }
const char HEARTBEAT_BYTE = 0;
}  // namespace

Runtime::RootHeartbeat::RootHeartbeat(const Runtime& rt) : rt_(rt), pending_(rt.world(), MPI_REQUEST_NULL) {
  if (rt_.world() == 1) return;
  thread_ = std::thread([this] {
    const double interval = heartbeat_interval(rt_.timeout_.seconds);
    double next = 0;
    while (!stop_) {
      if (now_seconds() >= next) {
        // A rank that has not taken the last beat (stopped) gets no new one: nothing piles up.
        for (int r = 1; r < rt_.world(); r++) {
          int taken = 1;
          if (pending_[r] != MPI_REQUEST_NULL) MPI_CHECK(MPI_Test(&pending_[r], &taken, MPI_STATUS_IGNORE));
          if (taken)
            MPI_CHECK(MPI_Isend(&HEARTBEAT_BYTE, 1, MPI_CHAR, r, TAG_HEARTBEAT, rt_.heartbeat_, &pending_[r]));
        }
        next = now_seconds() + interval;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  });
}

void Runtime::RootHeartbeat::stop() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

Runtime::RootHeartbeat::~RootHeartbeat() { stop(); }

void Runtime::RootHeartbeat::finish() {
  stop();
  if (rt_.world() == 1) return;
  // A waiting rank that stopped meanwhile never takes these: timed like any collective.
  Watchdog::Scope scope(rt_.watchdog_.get(), "the end of rank 0's work (on_root)");
  MPI_CHECK(MPI_Waitall(rt_.world(), pending_.data(), MPI_STATUSES_IGNORE));
  for (int r = 1; r < rt_.world(); r++)
    MPI_CHECK(MPI_Send(&HEARTBEAT_BYTE, 1, MPI_CHAR, r, TAG_WORK_DONE, rt_.heartbeat_));
}

void Runtime::wait_for_root(const char* what) const {
  double last = now_seconds();
  for (;;) {
    int arrived = 0;
    MPI_Status status;
    MPI_CHECK(MPI_Iprobe(0, MPI_ANY_TAG, heartbeat_, &arrived, &status));
    if (arrived) {
      char byte = 0;
      MPI_CHECK(MPI_Recv(&byte, 1, MPI_CHAR, 0, status.MPI_TAG, heartbeat_, MPI_STATUS_IGNORE));
      if (status.MPI_TAG == TAG_WORK_DONE) return;  // messages from one sender arrive in order
      last = now_seconds();
      continue;
    }
    const double silent = now_seconds() - last;
    if (timeout_.seconds > 0 && silent > timeout_.seconds) {
      std::fprintf(stderr,
                   "%s error: rank 0 sent no heartbeat for %.0f s while it ran %s alone (%s%s%g s): it is "
                   "stopped or dead; aborting all ranks\n",
                   rank_label().c_str(), silent, what, timeout_.option.c_str(), timeout_.option.empty() ? "" : "=",
                   timeout_.seconds);
      std::fflush(stderr);
      MPI_Abort(MPI_COMM_WORLD, EXIT_CODE_INTERNAL);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

MPI_Comm Runtime::split_world(int color, int key) const { return split(color, key, "MPI_Comm_split"); }

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

void Runtime::agree(const std::string& local_error, char kind) const {
  Watchdog::Scope scope(watchdog_.get(), "agreement on the inputs");
  // The kind travels as the message's first byte.
  const std::string error = agreed_error(local_error.empty() ? "" : kind + local_error, MPI_COMM_WORLD);
  if (!error.empty()) throw_input_error(error[0], error.substr(1));
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
