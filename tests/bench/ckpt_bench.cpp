// Checkpoint I/O benchmark: save_checkpoint / load_checkpoint of one model (default gpt2-124M) on
// the ranks of MPI_COMM_WORLD, against the disk's own sequential speed measured in the same run.
//
//   mpirun -np R build/ckpt_bench --layout sharded|gathered --dir DIR [--repeats N] [--warmup W]
//          [--threads T (0: as the trainer, cores / ranks)] [--profile 1] [--n_layer 12 --n_embd 768 --n_head 12 --vocab_size 50257 --max_seq_len 1024] [--seed 1]
//
// Per repeat, each timed step right after a page-cache drop (rank 0: sync; 3 > /proc/sys/vm/drop_caches;
// when that is not permitted, cold=0 is printed and the reads are warm-cache numbers):
//   (a) disk baseline on rank 0 (the other ranks wait at a sleeping barrier): write DIR/ckpt_bench_disk.bin,
//       the size of the checkpoint's data (3 tensors x params x 4 bytes), with 16 MiB write()
//       calls, then fsync + close, timed from open to the end of fsync; drop; read it back with
//       16 MiB read() calls (the cold sequential read); remove it.
//   (b) save: every rank writes 5 to /proc/self/clear_refs (peak RSS := current RSS) and reads its
//       VmRSS; barrier; save_checkpoint; barrier; rank 0 opens the file and fsyncs it (as
//       CheckpointManager does before the rename); timed on rank 0 from the first barrier to the
//       end of that fsync. Growth = VmHWM after the save - VmRSS before it, per rank.
//   (c) load: load_checkpoint timed across barriers (it also verifies every checksum).
// Dropping before the writes too keeps them comparable: on a VM a buffered write's speed depends
// on whether its page-cache pages were freed moments ago or must be faulted in fresh.
// The first W (default 1) repeats are printed as WARMUP lines and are not results: on a fresh VM
// the first pass over ~1.5 GB of page cache runs at a fraction of the later speed (the guest's
// memory is touched for the first time), for the baseline and the checkpoint alike.
// One line per repeat on rank 0:
//   RESULT layout=.. ranks=.. threads=.. bytes=.. save_s=.. save_fsync_s=.. disk_write_s=.. load_s=..
//          disk_read_s=.. cold=0|1 save_growth_mib_max=.. save_growth_mib_min=.. rss_before_mib_max=..
//          shard_mib=..
// bytes is the tensor data only (the file also holds metadata; its size is printed as file_bytes).
// shard_mib is the largest rank's params + exp_avg + exp_avg_sq shard, for reference. Memory the
// first save allocates and keeps (malloc does not return it; MPI-IO aggregation buffers) shows as
// growth only in that save, and as a higher rss_before in the later ones: hence the warm-up's
// growth counts too.
// --profile 1 adds, per repeat: checksum_s_max (the checksum pass over each rank's owned data that
// save_checkpoint makes before writing), and the same bytes written with MPI-IO alone, without
// HDF5, one call per dataset: mpiio_coll_s (MPI_File_write_at_all, as the save's collective
// H5Dwrite) and mpiio_indep_s (MPI_File_write_at), each + MPI_File_sync + rank 0's fsync.
// The files are removed afterwards.
#include <fcntl.h>
#include <mpi.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "app/perf.hpp"
#include "ckpt/checkpoint_io.hpp"
#include "comm/comm.hpp"
#include "model/param_table.hpp"
#include "optim/adamw.hpp"
#include "shard/fsdp_engine.hpp"
#include "shard/memory.hpp"

using namespace shardtrain;

namespace {

constexpr size_t CHUNK = size_t(16) << 20;

[[noreturn]] void die(const std::string& message) {
  std::fprintf(stderr, "ckpt_bench: %s\n", message.c_str());
  std::fflush(stderr);
  MPI_Abort(MPI_COMM_WORLD, 2);
  std::exit(2);
}

// A field of /proc/self/status in KiB.
long status_kib(const char* field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const size_t n = std::strlen(field);
  while (std::getline(in, line))
    if (line.compare(0, n, field) == 0 && line.size() > n && line[n] == ':') return std::atol(line.c_str() + n + 1);
  return -1;
}

bool write_proc(const char* path, const char* text) {
  int fd = open(path, O_WRONLY);
  if (fd < 0) return false;
  ssize_t n = write(fd, text, std::strlen(text));
  close(fd);
  return n == static_cast<ssize_t>(std::strlen(text));
}

// sync, then drop clean page cache, dentries and inodes. False if not permitted (not root,
// read-only /proc/sys in a container).
bool drop_caches() {
  sync();
  return write_proc("/proc/sys/vm/drop_caches", "3");
}

void fsync_file(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) die("cannot open '" + path + "' to sync: " + std::strerror(errno));
  if (fsync(fd) != 0) die("fsync of '" + path + "' failed: " + std::strerror(errno));
  close(fd);
}

// The baseline writer: `bytes` from a 16 MiB buffer of nonzero data, then fsync. Returns seconds.
double disk_write(const std::string& path, size_t bytes, const std::vector<char>& buffer) {
  const double t0 = MPI_Wtime();
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) die("cannot create '" + path + "': " + std::strerror(errno));
  size_t done = 0;
  while (done < bytes) {
    const size_t n = std::min(buffer.size(), bytes - done);
    ssize_t w = write(fd, buffer.data(), n);
    if (w <= 0) die("write to '" + path + "' failed: " + std::strerror(errno));
    done += static_cast<size_t>(w);
  }
  if (fsync(fd) != 0) die("fsync of '" + path + "' failed: " + std::strerror(errno));
  close(fd);
  return MPI_Wtime() - t0;
}

double disk_read(const std::string& path, size_t expected, std::vector<char>& buffer) {
  const double t0 = MPI_Wtime();
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) die("cannot open '" + path + "': " + std::strerror(errno));
  size_t done = 0;
  for (;;) {
    ssize_t r = read(fd, buffer.data(), buffer.size());
    if (r < 0) die("read of '" + path + "' failed: " + std::strerror(errno));
    if (r == 0) break;
    done += static_cast<size_t>(r);
  }
  close(fd);
  if (done != expected) die("short read of '" + path + "'");
  return MPI_Wtime() - t0;
}

// A barrier that sleeps instead of spinning: while rank 0 measures the disk alone, the other
// ranks must not take a core from it or from the kernel's writeback (Open MPI's MPI_Barrier
// polls at 100% CPU, and this machine may have as few cores as ranks).
void quiet_barrier() {
  MPI_Request request;
  MPI_Ibarrier(MPI_COMM_WORLD, &request);
  for (int done = 0;;) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return;
    usleep(1000);
  }
}

// Max and min over ranks.
void minmax(double value, double* lo, double* hi) {
  MPI_Allreduce(&value, hi, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  MPI_Allreduce(&value, lo, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
}

// --profile: the same bytes written without HDF5, to split the save's time. One piece per dataset
// in the order save_checkpoint writes them (unit, tensor, [parameter]), each rank writing the part
// it owns, at the offset the data has in a file of back-to-back datasets.
struct IoPiece {
  MPI_Offset offset;  // bytes
  const float* data;
  size_t count;       // elements (0: this rank contributes nothing to the dataset)
};

std::vector<IoPiece> io_pieces(const std::string& layout, FsdpEngine& engine, AdamW& optimizer) {
  const ParamTable& table = engine.table();
  std::vector<IoPiece> pieces;
  MPI_Offset base = 0;
  for (size_t u = 0; u < table.units().size(); u++) {
    const UnitLayout& shard = engine.shards()[u].layout;
    const float* buffers[3] = {engine.shards()[u].params.data(), optimizer.m()[u].data(), optimizer.v()[u].data()};
    for (int k = 0; k < 3; k++) {
      auto add = [&](size_t lo, size_t numel) {  // a dataset holding unit elements [lo, lo + numel)
        const UnitLayout::Local own = shard.local_part(FlatRange{lo, lo + numel}, true);  // nothing frozen
        IoPiece piece{base + static_cast<MPI_Offset>((own.range.begin - lo) * 4), buffers[k] + own.index,
                      own.range.size()};
        pieces.push_back(piece);
        base += static_cast<MPI_Offset>(numel * 4);
      };
      if (layout == "sharded") {
        add(0, shard.numel);
      } else {
        for (int id : table.units()[u].params) add(table.params()[id].offset, table.params()[id].numel);
      }
    }
  }
  return pieces;
}

// Writes the pieces with MPI-IO (collective: one MPI_File_write_at_all per dataset, as
// H5Dwrite with H5FD_MPIO_COLLECTIVE; else MPI_File_write_at), MPI_File_sync, close, and rank 0's
// fsync; timed across barriers like the save.
double mpiio_write(const std::string& path, const std::vector<IoPiece>& pieces, bool collective, int rank) {
  MPI_Barrier(MPI_COMM_WORLD);
  const double t0 = MPI_Wtime();
  MPI_File fh;
  if (MPI_File_open(MPI_COMM_WORLD, path.c_str(), MPI_MODE_CREATE | MPI_MODE_WRONLY, MPI_INFO_NULL, &fh) != MPI_SUCCESS)
    die("MPI_File_open of '" + path + "' failed");
  for (const IoPiece& p : pieces) {
    int rc = collective ? MPI_File_write_at_all(fh, p.offset, p.data, static_cast<int>(p.count), MPI_FLOAT,
                                                MPI_STATUS_IGNORE)
                        : p.count ? MPI_File_write_at(fh, p.offset, p.data, static_cast<int>(p.count), MPI_FLOAT,
                                                      MPI_STATUS_IGNORE)
                                  : MPI_SUCCESS;
    if (rc != MPI_SUCCESS) die("MPI-IO write to '" + path + "' failed");
  }
  MPI_File_sync(fh);
  MPI_File_close(&fh);
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) fsync_file(path);
  return MPI_Wtime() - t0;
}

struct Options {
  std::string layout = "sharded", dir;
  int repeats = 3, warmup = 1, threads = 0;
  bool profile = false;
  uint64_t seed = 1;
  ModelConfig model{"gpt2", 12, 768, 12, 50257, 1024};  // gpt2-124M
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i], value;
    const size_t eq = a.find('=');
    if (eq != std::string::npos) {
      value = a.substr(eq + 1), a = a.substr(0, eq);
    } else if (a.rfind("--", 0) == 0 && i + 1 < argc) {
      value = argv[++i];
    } else {
      die("argument '" + a + "' needs a value");
    }
    if (a == "--layout") o.layout = value;
    else if (a == "--dir") o.dir = value;
    else if (a == "--repeats") o.repeats = std::atoi(value.c_str());
    else if (a == "--warmup") o.warmup = std::atoi(value.c_str());
    else if (a == "--threads") o.threads = std::atoi(value.c_str());
    else if (a == "--profile") o.profile = value != "0";
    else if (a == "--seed") o.seed = std::strtoull(value.c_str(), nullptr, 10);
    else if (a == "--n_layer") o.model.n_layer = std::atoi(value.c_str());
    else if (a == "--n_embd") o.model.n_embd = std::atoi(value.c_str());
    else if (a == "--n_head") o.model.n_head = std::atoi(value.c_str());
    else if (a == "--vocab_size") o.model.vocab_size = std::atoi(value.c_str());
    else if (a == "--max_seq_len") o.model.max_seq_len = std::atoi(value.c_str());
    else die("unknown argument '" + a + "'");
  }
  if (o.layout != "sharded" && o.layout != "gathered") die("--layout must be sharded or gathered");
  if (o.dir.empty()) die("--dir DIR is required");
  if (o.repeats < 1) die("--repeats must be >= 1");
  if (o.warmup < 0) die("--warmup must be >= 0");
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  int provided = 0;
  MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);  // as the trainer's Runtime
  int rank = 0, ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const Options opt = parse(argc, argv);
  // Threads per rank as the trainer chooses them (train.threads = 0: the cores / ranks on this
  // node): the checksums run on OpenMP, and more threads than cores make every per-dataset
  // parallel region wait for cores held by the other ranks' MPI polling.
  MPI_Comm node;
  int local_ranks = 1;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
  MPI_Comm_size(node, &local_ranks);
  MPI_Comm_free(&node);
  const int threads = opt.threads > 0 ? opt.threads : default_threads_per_rank(local_ranks);
  set_compute_threads(threads);
  {
    auto world = make_mpi_comm(MPI_COMM_WORLD, nullptr);
    auto self = make_mpi_comm(MPI_COMM_SELF, nullptr);  // FULL_SHARD: no replicas
    ParamTable table(opt.model);
    MemoryTracker memory;
    FsdpEngine engine(table, *world, *self, memory, {}, cpu_backend());
    AdamW optimizer(OptimConfig{}, engine, memory);
    engine.init_parameters(opt.seed);
    // Nonzero moments, a function of the flat index (m signed, v positive).
    size_t shard_elems = 0;
    for (size_t u = 0; u < engine.shards().size(); u++) {
      const UnitShard& s = engine.shards()[u];
      DeviceArray<float>&m = optimizer.m()[u], &v = optimizer.v()[u];
      for (size_t i = 0; i < m.size(); i++) {
        const size_t g = s.layout.trainable.begin + i + u * 7919;
        m[i] = 1e-3f * static_cast<float>(static_cast<int>(g % 2001) - 1000);
        v[i] = 1e-6f * static_cast<float>(1 + g % 997);
      }
      shard_elems += s.params.size() + m.size() + v.size();
    }
    double shard_lo = 0, shard_hi = 0;
    minmax(static_cast<double>(shard_elems) * 4 / (1 << 20), &shard_lo, &shard_hi);

    const size_t data_bytes = 3 * table.total_params() * sizeof(float);
    const std::string base_path = opt.dir + "/ckpt_bench_disk.bin";
    const std::string ckpt_path = opt.dir + "/ckpt_bench_" + opt.layout + ".h5";
    const std::string mpiio_path = opt.dir + "/ckpt_bench_mpiio.bin";
    const std::vector<IoPiece> pieces = io_pieces(opt.layout, engine, optimizer);
    std::vector<char> buffer;
    if (rank == 0) {
      buffer.resize(CHUNK);
      for (size_t i = 0; i < buffer.size(); i++) buffer[i] = static_cast<char>((i * 2654435761u) >> 13);
      mkdir(opt.dir.c_str(), 0755);
      std::printf("ckpt_bench: layout=%s ranks=%d threads=%d params=%zu bytes=%zu units=%zu params_in_table=%zu "
                  "datasets=%zu\n",
                  opt.layout.c_str(), ranks, threads, table.total_params(), data_bytes, table.units().size(),
                  table.params().size(), opt.layout == "sharded" ? 3 * table.units().size() : 3 * table.params().size());
      std::fflush(stdout);
    }

    CheckpointState state;
    state.layout = opt.layout;
    state.seed = opt.seed;
    state.world_size = ranks;
    state.model = opt.model;
    for (int rep = -opt.warmup; rep < opt.repeats; rep++) {
      // Every timed write and read starts right after a page-cache drop, so the baseline and the
      // checkpoint find the same clean memory: on this kind of VM a write's speed depends on
      // whether its page-cache pages were freed moments ago or must be faulted in fresh.
      int cold = 1;
      auto drop = [&] {
        int ok = rank == 0 ? (drop_caches() ? 1 : 0) : 1;
        quiet_barrier();
        MPI_Bcast(&ok, 1, MPI_INT, 0, MPI_COMM_WORLD);
        cold = cold && ok;
      };

      // (a) the disk's sequential write and cold read speed, fsync included in the write.
      drop();
      double disk_write_s = 0, disk_read_s = 0;
      if (rank == 0) disk_write_s = disk_write(base_path, data_bytes, buffer);
      drop();
      if (rank == 0) {
        disk_read_s = disk_read(base_path, data_bytes, buffer);
        std::remove(base_path.c_str());  // also frees its cached pages when the drop is not allowed
      }
      quiet_barrier();

      // (b) the save, with the peak-RSS growth it causes.
      drop();
      if (!write_proc("/proc/self/clear_refs", "5")) die("cannot write /proc/self/clear_refs");
      const long rss_before = status_kib("VmRSS");
      MPI_Barrier(MPI_COMM_WORLD);
      const double t0 = MPI_Wtime();
      try {
        save_checkpoint(ckpt_path, state, engine, optimizer, CheckpointComm{*world, MPI_COMM_WORLD});
      } catch (const std::exception& e) {
        die(std::string("save failed: ") + e.what());
      }
      const long hwm_after = status_kib("VmHWM");
      MPI_Barrier(MPI_COMM_WORLD);
      const double t1 = MPI_Wtime();
      if (rank == 0) fsync_file(ckpt_path);
      const double t2 = MPI_Wtime();
      double growth_lo = 0, growth_hi = 0, rss_lo = 0, rss_hi = 0;
      minmax(static_cast<double>(hwm_after - rss_before) / 1024, &growth_lo, &growth_hi);
      minmax(static_cast<double>(rss_before) / 1024, &rss_lo, &rss_hi);
      struct stat st {};
      if (rank == 0) stat(ckpt_path.c_str(), &st);

      // (c) the cold load (it verifies every checksum too).
      drop();
      MPI_Barrier(MPI_COMM_WORLD);
      const double t3 = MPI_Wtime();
      try {
        load_checkpoint(ckpt_path, engine, optimizer, CheckpointComm{*world, MPI_COMM_WORLD});
      } catch (const std::exception& e) {
        die(std::string("load failed: ") + e.what());
      }
      MPI_Barrier(MPI_COMM_WORLD);
      const double t4 = MPI_Wtime();

      // --profile: the save's parts, each after a drop. The checksum pass over the owned data
      // (save_checkpoint runs it before writing); the same bytes through MPI-IO without HDF5,
      // collective (one call per dataset) and independent.
      std::string profile;
      if (opt.profile) {
        MPI_Barrier(MPI_COMM_WORLD);
        const double c0 = MPI_Wtime();
        uint64_t sum = 0;
        for (const IoPiece& p : pieces) sum += checksum_elements(p.data, p.count, 0);
        double checksum_s = MPI_Wtime() - c0, checksum_lo = 0, checksum_hi = 0;
        minmax(checksum_s, &checksum_lo, &checksum_hi);
        if (sum == 42) std::printf(" ");  // keeps the loop
        drop();
        const double coll_s = mpiio_write(mpiio_path, pieces, true, rank);
        if (rank == 0) std::remove(mpiio_path.c_str());
        drop();
        const double indep_s = mpiio_write(mpiio_path, pieces, false, rank);
        if (rank == 0) std::remove(mpiio_path.c_str());
        profile = strprintf(" checksum_s_max=%.4f mpiio_coll_s=%.4f mpiio_indep_s=%.4f", checksum_hi, coll_s, indep_s);
      }

      if (rank == 0) {
        std::printf("%s layout=%s ranks=%d threads=%d bytes=%zu file_bytes=%lld save_s=%.4f save_fsync_s=%.4f "
                    "disk_write_s=%.4f load_s=%.4f disk_read_s=%.4f cold=%d save_growth_mib_max=%.2f "
                    "save_growth_mib_min=%.2f rss_before_mib_max=%.1f shard_mib=%.2f%s%s\n",
                    rep < 0 ? "WARMUP" : "RESULT", opt.layout.c_str(), ranks, threads, data_bytes, static_cast<long long>(st.st_size), t2 - t0, t2 - t1,
                    disk_write_s, t4 - t3, disk_read_s, cold, growth_hi, growth_lo, rss_hi, shard_hi, profile.c_str(),
                    cold ? "" : " (warm cache: drop_caches not permitted)");
        std::fflush(stdout);
        std::remove(ckpt_path.c_str());
      }
      MPI_Barrier(MPI_COMM_WORLD);
    }
  }
  MPI_Finalize();
  return 0;
}
