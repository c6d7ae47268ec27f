// See checkpoint_manager.hpp. Folder operations run on rank 0; their outcome is agreed.
#include "ckpt/checkpoint_manager.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

namespace shardtrain {
namespace fs = std::filesystem;

namespace {

// The step of "ckpt-00000020.h5", or -1 for any other name.
int64_t step_of(const std::string& name) {
  if (name.size() != 16 || name.compare(0, 5, "ckpt-") != 0 || name.compare(13, 3, ".h5") != 0) return -1;
  for (size_t i = 5; i < 13; i++)
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return -1;
  return std::stoll(name.substr(5, 8));
}

// Sorted newest first.
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    int64_t step = step_of(entry.path().filename().string());
    if (step >= 0) found.emplace_back(step, entry.path().string());
  }
  std::sort(found.rbegin(), found.rend());
  return found;
}

}  // namespace

CheckpointManager::CheckpointManager(const Runtime& rt, Comm& comm, std::string dir, int keep, Watchdog* watchdog)
    : rt_(rt), comm_(comm), dir_(std::move(dir)), keep_(keep), watchdog_(watchdog) {
  SHARD_CHECK(comm_.size() == rt_.world(), "checkpoints are written by all %d ranks, not %d", rt_.world(),
              comm_.size());
}

std::string CheckpointManager::file_name(int64_t step) {
  return strprintf("ckpt-%08lld.h5", static_cast<long long>(step));
}

std::string CheckpointManager::fsync_path(const std::string& path) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) return "cannot open '" + path + "' to sync: " + std::strerror(errno);
  int rc = fsync(fd);
  close(fd);
  return rc == 0 ? "" : "fsync of '" + path + "' failed: " + std::strerror(errno);
}

std::string CheckpointManager::commit_synced(const std::string& tmp, const std::string& final_path,
                                             const std::string& dir) {
  std::string error = fsync_path(tmp);
  if (error.empty() && std::rename(tmp.c_str(), final_path.c_str()) != 0)
    error = "cannot rename '" + tmp + "' to '" + final_path + "': " + std::strerror(errno);
  return error.empty() ? fsync_path(dir) : error;
}

std::string CheckpointManager::write_file_synced(const std::string& path, const std::string& text) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return "cannot write '" + path + "': " + std::strerror(errno);
  int error = 0;
  for (size_t done = 0; done < text.size() && !error;) {
    ssize_t n = write(fd, text.data() + done, text.size() - done);
    if (n > 0)
      done += static_cast<size_t>(n);
    else if (n == 0 || errno != EINTR)
      error = n == 0 ? EIO : errno;
  }
  if (!error && fsync(fd) != 0) error = errno;
  if (close(fd) != 0 && !error) error = errno;
  return error ? "cannot write '" + path + "': " + std::strerror(error) : "";
}

void CheckpointManager::check_dir() {
  std::string error;
  if (rt_.is_root()) {
    // The nearest part of the path that exists must be a folder.
    std::error_code ec;
    for (fs::path p = dir_; !p.empty(); p = p.parent_path()) {
      fs::file_status st = fs::status(p, ec);
      if (fs::exists(st)) {
        if (!fs::is_directory(st))
          error = "checkpoint.dir '" + dir_ + "' " +
                  (p == fs::path(dir_) ? "is a file" : "cannot be created: '" + p.string() + "' is a file") +
                  "; name a folder (it is created if missing)";
        break;
      }
      if (p == p.parent_path()) break;
    }
  }
  rt_.agree(error);
}

std::string CheckpointManager::save(const CheckpointState& state, FsdpEngine& engine, AdamW& optimizer) {
  const std::string final_path = dir_ + "/" + file_name(state.step);
  const std::string tmp_path = final_path + ".tmp";
  std::string error;
  if (rt_.is_root()) {
    std::error_code ec;
    fs::create_directories(dir_, ec);
    if (ec) error = "cannot create checkpoint.dir '" + dir_ + "': " + ec.message();
  }
  rt_.agree(error);
  try {
    rt_.agree_on([&] { save_checkpoint(tmp_path, state, engine, optimizer, ranks()); });
  } catch (const InputError& e) {
    if (rt_.is_root()) std::remove(tmp_path.c_str());  // never leave a half-written file behind
    throw InputError(std::string("checkpoint save failed: ") + e.what());
  }
  if (rt_.is_root()) {
    // Data first, then the name: a crash at any point leaves either no new checkpoint or a
    // complete one, and `latest` only ever names complete files.
    error = commit_synced(tmp_path, final_path, dir_);
    if (error.empty()) {
      const std::string latest_tmp = dir_ + "/latest.tmp";
      error = write_file_synced(latest_tmp, file_name(state.step) + "\n");
      if (error.empty() && std::rename(latest_tmp.c_str(), (dir_ + "/latest").c_str()) != 0)
        error = "cannot update '" + dir_ + "/latest': " + std::strerror(errno);
      if (!error.empty()) std::remove(latest_tmp.c_str());  // `latest` still names the previous checkpoint
      if (error.empty()) error = fsync_path(dir_);
    }
    if (error.empty()) prune(state.step);
    if (!error.empty()) std::remove(tmp_path.c_str());
  }
  rt_.agree(error.empty() ? "" : "checkpoint save failed: " + error);
  return final_path;
}

void CheckpointManager::prune(int64_t newest_step) {
  const std::string best = read_best().first;
  auto found = complete_checkpoints(dir_);
  for (size_t i = static_cast<size_t>(keep_); i < found.size(); i++)
    if (found[i].first < newest_step && fs::path(found[i].second).filename() != best)
      std::remove(found[i].second.c_str());
}

std::pair<std::string, double> CheckpointManager::read_best() const {
  std::ifstream in(dir_ + "/best");
  std::string name;
  double loss = 0;
  if (in >> name >> loss && step_of(name) >= 0 && std::isfinite(loss) && fs::exists(dir_ + "/" + name))
    return {name, loss};
  return {"", INFINITY};
}

void CheckpointManager::mark_best(int64_t step, double val_loss) {
  std::string error;
  if (rt_.is_root()) {
    const std::string tmp = dir_ + "/best.tmp";
    error = write_file_synced(tmp, strprintf("%s %.17g\n", file_name(step).c_str(), val_loss));
    if (error.empty() && std::rename(tmp.c_str(), (dir_ + "/best").c_str()) != 0)
      error = "cannot update '" + dir_ + "/best': " + std::strerror(errno);
    if (!error.empty()) std::remove(tmp.c_str());  // `best` still names the previous best
    if (error.empty()) error = fsync_path(dir_);
    if (error.empty()) prune(step);  // the previous best, if beyond the newest kept
  }
  rt_.agree(error.empty() ? "" : "checkpoint save failed: " + error);
}

double CheckpointManager::best_val_loss() {
  double loss = rt_.is_root() ? read_best().second : 0;
  comm_.broadcast(Span<char>(reinterpret_cast<char*>(&loss), sizeof loss), 0, "broadcast(best validation loss)");
  return loss;
}

CheckpointState CheckpointManager::load(const std::string& path, FsdpEngine& engine, AdamW& optimizer,
                                        bool base_model_ok) {
  return load_checkpoint(path, engine, optimizer, ranks(), base_model_ok);
}

CheckpointState CheckpointManager::load_weights(const std::string& path, FsdpEngine& engine, bool base_model_ok) {
  return load_checkpoint_weights(path, engine, ranks(), base_model_ok);
}

std::vector<std::string> CheckpointManager::candidates() {
  check_dir();
  std::string joined;
  if (rt_.is_root()) {
    std::vector<std::string> list;
    std::ifstream latest(dir_ + "/latest");
    std::string name;
    if (latest >> name && step_of(name) >= 0 && fs::exists(dir_ + "/" + name)) list.push_back(dir_ + "/" + name);
    for (const auto& [step, path] : complete_checkpoints(dir_))
      if (std::find(list.begin(), list.end(), path) == list.end()) list.push_back(path);
    for (const std::string& p : list) joined += p + "\n";
  }
  uint64_t size = joined.size();
  comm_.broadcast(Span<char>(reinterpret_cast<char*>(&size), sizeof size), 0, "broadcast(checkpoint list)");
  joined.resize(size);
  comm_.broadcast(Span<char>(joined.data(), joined.size()), 0, "broadcast(checkpoint list)");
  std::vector<std::string> list;
  size_t start = 0;
  for (size_t nl; (nl = joined.find('\n', start)) != std::string::npos; start = nl + 1)
    list.push_back(joined.substr(start, nl - start));
  return list;
}

}  // namespace shardtrain
