// TensorBoard event files written by rank 0 itself, without TensorFlow or a protobuf library.
//
// An event file is a sequence of TFRecords: u64 little-endian payload length, masked CRC-32C of
// those 8 bytes, the payload, masked CRC-32C of the payload. Each payload is a hand-encoded
// tensorboard.Event: the first one says file_version "brain.Event:2", each later one carries one
// scalar as Summary.Value{tag, simple_value} or one PNG image as Summary.Value{tag, image}.
// docs/monitoring.md shows how to look at them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shardtrain {

class TensorBoardWriter {
 public:
  // Writes into `dir` (created if missing) when non-empty and `enabled` (rank 0); otherwise a no-op.
  // resume_step >= 0: a resumed run; points with step > resume_step that an earlier run left are
  // removed from the folder's event files, so TensorBoard does not show them after a rewind.
  // resume_step < 0: a fresh run, which removes the points of earlier runs in the folder, as the
  // metrics file is truncated. Throws UsageError when the folder cannot be created or written.
  TensorBoardWriter(const std::string& dir, bool enabled, long resume_step);
  ~TensorBoardWriter();
  TensorBoardWriter(const TensorBoardWriter&) = delete;
  TensorBoardWriter& operator=(const TensorBoardWriter&) = delete;

  void scalar(const std::string& tag, long step, double value);
  // An RGB image, its PNG file's bytes (TensorBoard's Images tab).
  void image(const std::string& tag, long step, int height, int width, const std::string& png);
  // Whether it writes anything (a folder was given, on rank 0).
  bool enabled() const { return fd_ >= 0; }
  // Writes the scalars and images given since the last flush; throws InputError naming the file
  // when the write fails (a full disk).
  void flush();
  // The event file this writer appends to; empty when it writes nothing.
  const std::string& path() const { return path_; }

 private:
  void write_all(const std::string& bytes);

  std::string path_;
  int fd_ = -1;
  std::string pending_;
};

// The record format, exposed for the tests.
namespace tfevents {

uint32_t masked_crc(const std::string& bytes);
std::string frame(const std::string& payload);  // one TFRecord
std::string file_version_event(double wall_time);
std::string scalar_event(double wall_time, long step, const std::string& tag, float value);
std::string image_event(double wall_time, long step, const std::string& tag, int height, int width,
                        const std::string& png);

struct Record {
  std::string payload;
  long step = 0;             // Event.step
  bool has_summary = false;  // Event.summary present
  std::string tag;           // of the summary's first value
  float value = 0;           // its simple_value
};
// The whole records of an event file up to the first torn or corrupt one; *clean tells whether
// they make up the whole file. Throws UsageError when the file cannot be read.
std::vector<Record> read_records(const std::string& path, bool* clean);

}  // namespace tfevents
}  // namespace shardtrain
