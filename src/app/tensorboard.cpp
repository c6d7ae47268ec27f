// See tensorboard.hpp. Field numbers are those of tensorboard/compat/proto/event.proto and
// summary.proto: Event{wall_time 1 double, step 2 int64, file_version 3 string, summary 5},
// Summary{value 1 repeated}, Summary.Value{tag 1 string, simple_value 2 float}.
#include "app/tensorboard.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "core/crc32c.hpp"
#include "core/error.hpp"

namespace shardtrain {
namespace tfevents {
namespace {

enum WireType { VARINT = 0, FIXED64 = 1, LENGTH_DELIMITED = 2, FIXED32 = 5 };

void put_le(std::string& out, uint64_t bits, int bytes) {
  for (int i = 0; i < bytes; i++) out += static_cast<char>((bits >> (8 * i)) & 0xFF);
}

uint64_t get_le(const char* p, int bytes) {
  uint64_t bits = 0;
  for (int i = 0; i < bytes; i++) bits |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return bits;
}

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += static_cast<char>((v & 0x7F) | 0x80);
  out += static_cast<char>(v);
}

void put_key(std::string& out, int field, WireType wire) { put_varint(out, static_cast<uint64_t>(field) << 3 | wire); }

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_key(out, field, LENGTH_DELIMITED);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event.wall_time and Event.step, the fields every event has.
std::string event_head(double wall_time, long step) {
  std::string out;
  uint64_t bits;
  std::memcpy(&bits, &wall_time, sizeof bits);
  put_key(out, 1, FIXED64);
  put_le(out, bits, 8);
  put_key(out, 2, VARINT);
  put_varint(out, static_cast<uint64_t>(static_cast<int64_t>(step)));  // int64: two's complement
  return out;
}

bool get_varint(const std::string& s, size_t& at, uint64_t& v) {
  v = 0;
  for (int shift = 0; at < s.size() && shift < 64; shift += 7) {
    const auto byte = static_cast<unsigned char>(s[at++]);
    v |= static_cast<uint64_t>(byte & 0x7F) << shift;
    if (!(byte & 0x80)) return true;
  }
  return false;
}

// Calls visit(field, wire type, number, bytes) for each field of a message: `number` holds varint
// and fixed values, `bytes` length-delimited ones. Returns false at a field it cannot parse.
template <class Visit>
bool for_each_field(const std::string& s, Visit visit) {
  for (size_t at = 0; at < s.size();) {
    uint64_t key, number = 0;
    std::string bytes;
    if (!get_varint(s, at, key)) return false;
    const int wire = static_cast<int>(key & 7), size = wire == FIXED64 ? 8 : 4;
    if (wire == VARINT) {
      if (!get_varint(s, at, number)) return false;
    } else if (wire == FIXED64 || wire == FIXED32) {
      if (s.size() - at < static_cast<size_t>(size)) return false;
      number = get_le(s.data() + at, size), at += size;
    } else if (wire == LENGTH_DELIMITED) {
      if (!get_varint(s, at, number) || number > s.size() - at) return false;
      bytes = s.substr(at, number), at += number;
    } else {
      return false;
    }
    visit(static_cast<int>(key >> 3), wire, number, bytes);
  }
  return true;
}

// Event.step, and the tag and simple_value of the summary's first value.
void parse_event(Record& r) {
  for_each_field(r.payload, [&](int field, int wire, uint64_t number, const std::string& bytes) {
    if (field == 2 && wire == VARINT) r.step = static_cast<long>(static_cast<int64_t>(number));
    if (field != 5 || wire != LENGTH_DELIMITED) return;
    r.has_summary = true;
    for_each_field(bytes, [&](int, int, uint64_t, const std::string& value) {
      if (!r.tag.empty()) return;
      for_each_field(value, [&](int f, int w, uint64_t bits, const std::string& tag) {
        if (f == 1 && w == LENGTH_DELIMITED) r.tag = tag;
        const auto simple = static_cast<uint32_t>(bits);
        if (f == 2 && w == FIXED32) std::memcpy(&r.value, &simple, sizeof simple);
      });
    });
  });
}

}  // namespace

uint32_t masked_crc(const std::string& bytes) {
  const uint32_t crc = crc32c(bytes.data(), bytes.size());
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string frame(const std::string& payload) {
  std::string length;
  put_le(length, payload.size(), 8);
  std::string out = length;
  put_le(out, masked_crc(length), 4);
  out += payload;
  put_le(out, masked_crc(payload), 4);
  return out;
}

std::string file_version_event(double wall_time) {
  std::string out = event_head(wall_time, 0);
  put_bytes(out, 3, "brain.Event:2");
  return out;
}

namespace {

// An Event carrying a Summary of one Summary.Value (its fields after the tag, already encoded).
std::string summary_event(double wall_time, long step, const std::string& tag, const std::string& value_fields) {
  std::string summary_value;
  put_bytes(summary_value, 1, tag);
  summary_value += value_fields;
  std::string summary;
  put_bytes(summary, 1, summary_value);
  std::string out = event_head(wall_time, step);
  put_bytes(out, 5, summary);
  return out;
}

}  // namespace

std::string scalar_event(double wall_time, long step, const std::string& tag, float value) {
  std::string simple_value;
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  put_key(simple_value, 2, FIXED32);
  put_le(simple_value, bits, 4);
  return summary_event(wall_time, step, tag, simple_value);
}

std::string image_event(double wall_time, long step, const std::string& tag, int height, int width,
                        const std::string& png) {
  std::string image;  // Summary.Image: height, width, colorspace (3: RGB), encoded_image_string
  put_key(image, 1, VARINT), put_varint(image, static_cast<uint64_t>(height));
  put_key(image, 2, VARINT), put_varint(image, static_cast<uint64_t>(width));
  put_key(image, 3, VARINT), put_varint(image, 3);
  put_bytes(image, 4, png);
  std::string image_value;
  put_bytes(image_value, 4, image);
  return summary_event(wall_time, step, tag, image_value);
}

std::vector<Record> read_records(const std::string& path, bool* clean) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw UsageError("cannot read TensorBoard event file '" + path + "': " + std::strerror(errno));
  const std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<Record> records;
  size_t at = 0;
  while (data.size() - at >= 12) {
    const std::string length = data.substr(at, 8);
    const uint64_t n = get_le(data.data() + at, 8);
    if (get_le(data.data() + at + 8, 4) != masked_crc(length) || n > data.size() - at - 16) break;
    Record r;
    r.payload = data.substr(at + 12, n);
    if (get_le(data.data() + at + 12 + n, 4) != masked_crc(r.payload)) break;
    parse_event(r);
    records.push_back(std::move(r));
    at += 16 + n;
  }
  *clean = at == data.size();
  return records;
}

}  // namespace tfevents

namespace {

// Not "tfevents" in the name: TensorBoard reads every file whose name contains it.
const char* const REWRITE_TMP = ".shardtrain-rewind.tmp";

double wall_time_now() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

std::string dir_error(const std::string& dir, const std::string& why) {
  return "cannot write train.tensorboard_dir '" + dir + "': " + why +
         " (name a folder that can be created and written, or leave it empty for no TensorBoard files)";
}

// Writes all of `bytes`; returns 0 or the errno of the failed write.
int write_fd(int fd, const std::string& bytes) {
  for (size_t done = 0; done < bytes.size();) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno != EINTR) return errno;
    if (n > 0) done += static_cast<size_t>(n);
  }
  return 0;
}

// Replaces `path` by `records`, atomically: a crash leaves either the old or the new file.
void rewrite(const std::string& dir, const std::string& path, const std::vector<tfevents::Record>& records) {
  const std::string tmp = dir + "/" + REWRITE_TMP;
  std::string bytes;
  for (const auto& r : records) bytes += tfevents::frame(r.payload);
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw UsageError(dir_error(dir, std::strerror(errno)));
  int error = write_fd(fd, bytes);
  if (!error && ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && !error) error = errno;
  if (!error && std::rename(tmp.c_str(), path.c_str()) != 0) error = errno;
  if (error) {
    std::remove(tmp.c_str());
    throw UsageError(dir_error(dir, std::strerror(error)));
  }
}

// Removes the points with step > last_step from the event files in `dir` (all points when
// last_step < 0). TensorBoard's default loader (the Rust data server) does not honour
// SessionLog.START, so purging the files is the only way it stops showing a rewound run's points.
// Files without any point are not ours to judge and stay. Returns the newest file's timestamp.
long rewind_event_files(const std::string& dir, long last_step) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::remove(dir + "/" + REWRITE_TMP, ec);  // left by a crash during a rewrite
  long newest = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.find("tfevents") == std::string::npos || !entry.is_regular_file()) continue;
    bool clean;
    const auto records = tfevents::read_records(entry.path().string(), &clean);
    std::vector<tfevents::Record> kept;
    size_t points = 0, kept_points = 0;
    for (const auto& r : records) {
      points += r.has_summary;
      if (r.step > last_step) continue;
      kept.push_back(r);
      kept_points += r.has_summary;
    }
    if (points > 0 && kept_points == 0) {
      if (!fs::remove(entry.path(), ec)) throw UsageError(dir_error(dir, ec.message()));
      continue;
    }
    if (points > 0 && (kept.size() < records.size() || !clean)) rewrite(dir, entry.path().string(), kept);
    const size_t stamp = name.find("tfevents.");  // events.out.tfevents.<seconds>.<host>
    if (stamp != std::string::npos) newest = std::max(newest, std::atol(name.c_str() + stamp + 9));
  }
  return newest;
}

std::string hostname() {
  char name[256] = {};
  if (gethostname(name, sizeof name - 1) != 0 || !name[0]) return "localhost";
  return name;
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string& dir, bool enabled, long resume_step) {
  if (dir.empty() || !enabled) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) throw UsageError(dir_error(dir, ec.message()));
  if (!std::filesystem::is_directory(dir)) throw UsageError(dir_error(dir, std::strerror(ENOTDIR)));
  long newest;
  try {
    newest = rewind_event_files(dir, resume_step);
  } catch (const std::filesystem::filesystem_error& e) {
    throw UsageError(dir_error(dir, e.code().message()));
  }
  // TensorBoard reads a folder's files in name order: the new file must sort after the older ones,
  // even when they were written by a host whose clock was ahead.
  const long seconds = std::max(static_cast<long>(std::time(nullptr)), newest + 1);
  path_ = dir + "/" + strprintf("events.out.tfevents.%010ld.%s", seconds, hostname().c_str());
  fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
  if (fd_ < 0) throw UsageError(dir_error(dir, std::strerror(errno)));
  write_all(tfevents::frame(tfevents::file_version_event(wall_time_now())));
}

TensorBoardWriter::~TensorBoardWriter() {
  if (fd_ < 0) return;
  try {
    flush();
  } catch (const InputError&) {
    // Destructors must not throw; only scalars never flushed are lost.
  }
  ::close(fd_);
}

void TensorBoardWriter::scalar(const std::string& tag, long step, double value) {
  if (fd_ < 0) return;
  pending_ += tfevents::frame(tfevents::scalar_event(wall_time_now(), step, tag, static_cast<float>(value)));
}

void TensorBoardWriter::image(const std::string& tag, long step, int height, int width, const std::string& png) {
  if (fd_ < 0) return;
  pending_ += tfevents::frame(tfevents::image_event(wall_time_now(), step, tag, height, width, png));
}

void TensorBoardWriter::flush() {
  if (fd_ < 0 || pending_.empty()) return;
  std::string bytes;
  bytes.swap(pending_);
  write_all(bytes);
}

void TensorBoardWriter::write_all(const std::string& bytes) {
  if (const int error = write_fd(fd_, bytes))
    throw InputError("cannot write TensorBoard event file '" + path_ + "': " + std::strerror(error));
}

}  // namespace shardtrain
