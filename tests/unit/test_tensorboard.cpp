// Unit tests of src/core/crc32c and src/app/tensorboard: the checksum against the standard check
// value, the TFRecord framing and Event encoding against bytes worked out by hand from the format
// (the record of "hello" by an independent bit-wise CRC-32C), and the writer's files, rewinds and
// errors. tests/e2e/test_tensorboard.py runs TensorBoardWriterTest.RewoundRunShowsOnlyKeptPoints
// with SHARDTRAIN_TB_SCENARIO_DIR set and reads the files it leaves with the tensorboard package.
#include <gtest/gtest.h>
#include <sys/resource.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <string>
#include <vector>

#include "app/tensorboard.hpp"
#include "core/crc32c.hpp"
#include "core/error.hpp"

namespace shardtrain {
namespace {

namespace fs = std::filesystem;

std::string bytes(std::initializer_list<int> values) {
  std::string s;
  for (int v : values) s += static_cast<char>(v);
  return s;
}

TEST(Crc32c, StandardCheckValue) {
  const std::string digits = "123456789";
  EXPECT_EQ(crc32c(digits.data(), digits.size()), 0xE3069283u);
  EXPECT_EQ(crc32c(digits.data() + 4, 5, crc32c(digits.data(), 4)), 0xE3069283u);  // continued
  EXPECT_EQ(crc32c("", 0), 0u);
}

TEST(TensorBoardFormat, MasksTheCrc) {
  // ((0xE3069283 >> 15) | (0xE3069283 << 17)) + 0xa282ead8, modulo 2^32.
  EXPECT_EQ(tfevents::masked_crc("123456789"), 0xC78AB0E5u);
}

TEST(TensorBoardFormat, FramesAKnownRecord) {
  const std::string expected = bytes({0x05, 0, 0, 0, 0, 0, 0, 0, 0xea, 0xb2, 0x04, 0x3e}) + "hello" +
                               bytes({0xbb, 0x1f, 0x1c, 0x19});
  EXPECT_EQ(tfevents::frame("hello"), expected);
}

TEST(TensorBoardFormat, EncodesEvents) {
  // wall_time 1.5 (field 1, fixed64), step (field 2, varint), then file_version (field 3) or
  // summary (field 5) holding Value{tag (1), simple_value 2.0f (field 2, fixed32)}.
  const std::string head = bytes({0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, 0x10});
  EXPECT_EQ(tfevents::file_version_event(1.5), head + bytes({0x00, 0x1a, 13}) + "brain.Event:2");
  EXPECT_EQ(tfevents::scalar_event(1.5, 300, "a/b", 2.0f),
            head + bytes({0xac, 0x02, 0x2a, 12, 0x0a, 10, 0x0a, 3}) + "a/b" + bytes({0x15, 0, 0, 0, 0x40}));
}

class TensorBoardWriterTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/shardtrain_test_tb_XXXXXX";
    ASSERT_NE(mkdtemp(name), nullptr) << std::strerror(errno);
    tmp_ = name;
  }
  void TearDown() override { fs::remove_all(tmp_); }

  // The event files of `dir` in name order, as TensorBoard reads them.
  static std::vector<std::string> event_files(const std::string& dir) {
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().filename().string().find("tfevents") != std::string::npos) files.push_back(e.path().string());
    std::sort(files.begin(), files.end());
    return files;
  }
  // Every point in `dir` as tag -> (step, value), read back by the writer's own reader.
  static std::map<std::string, std::vector<std::pair<long, float>>> points(const std::string& dir) {
    std::map<std::string, std::vector<std::pair<long, float>>> by_tag;
    for (const auto& file : event_files(dir)) {
      bool clean;
      for (const auto& r : tfevents::read_records(file, &clean))
        if (r.has_summary) by_tag[r.tag].emplace_back(r.step, r.value);
      EXPECT_TRUE(clean) << file;
    }
    return by_tag;
  }
  static void run(const std::string& dir, long resume_step, long first, long last, double offset) {
    TensorBoardWriter tb(dir, true, resume_step);
    for (long step = first; step <= last; step++) {
      tb.scalar("train/loss", step, offset + 0.5 * static_cast<double>(step));
      if (step % 3 == 0) tb.scalar("val/loss", step, offset + 0.25 * static_cast<double>(step));
      tb.flush();
    }
  }
  std::string tmp_;
};

TEST_F(TensorBoardWriterTest, WritesFileVersionFirstThenScalars) {
  const std::string dir = tmp_ + "/new/tb";  // created with its parents
  {
    TensorBoardWriter tb(dir, true, -1);
    EXPECT_TRUE(std::regex_match(fs::path(tb.path()).filename().string(),
                                 std::regex(R"(events\.out\.tfevents\.\d{10}\.[^/]+)")))
        << tb.path();
    tb.scalar("perf/mfu", 1, 0.25);
    tb.scalar("train/loss", 1, 5.5);
    tb.flush();
  }
  ASSERT_EQ(event_files(dir).size(), 1u);
  bool clean;
  const auto records = tfevents::read_records(event_files(dir)[0], &clean);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_TRUE(clean);
  EXPECT_NE(records[0].payload.find("brain.Event:2"), std::string::npos);
  EXPECT_FALSE(records[0].has_summary);
  EXPECT_TRUE(records[1].has_summary && records[2].has_summary);
  EXPECT_EQ(records[2].step, 1);
  EXPECT_EQ(records[2].tag, "train/loss");
  EXPECT_EQ(records[2].value, 5.5f);
}

TEST_F(TensorBoardWriterTest, DisabledOrWithoutFolderWritesNothing) {
  TensorBoardWriter off(tmp_ + "/off", false, -1);
  off.scalar("train/loss", 1, 1.0);
  off.flush();
  EXPECT_FALSE(fs::exists(tmp_ + "/off"));
  EXPECT_TRUE(off.path().empty());
  TensorBoardWriter none("", true, -1);
  none.scalar("train/loss", 1, 1.0);
  none.flush();
}

// A run to step 7, a torn record at its end (a kill), then a resume from step 3's checkpoint.
// SHARDTRAIN_TB_SCENARIO_DIR: write there and keep the files (tests/e2e/test_tensorboard.py).
TEST_F(TensorBoardWriterTest, RewoundRunShowsOnlyKeptPoints) {
  const char* scenario = std::getenv("SHARDTRAIN_TB_SCENARIO_DIR");
  const std::string dir = scenario ? scenario : tmp_ + "/tb";
  run(dir, -1, 1, 7, 0);
  std::ofstream(event_files(dir).back(), std::ios::app) << std::string(9, '\x01');
  std::ofstream(dir + "/notes.txt") << "not an event file\n";
  run(dir, 3, 4, 5, 100);
  const auto got = points(dir);
  using Points = std::vector<std::pair<long, float>>;
  EXPECT_EQ(got.at("train/loss"), (Points{{1, 0.5f}, {2, 1.0f}, {3, 1.5f}, {4, 102.0f}, {5, 102.5f}}));
  EXPECT_EQ(got.at("val/loss"), (Points{{3, 0.75f}}));
  EXPECT_EQ(event_files(dir).size(), 2u);
  EXPECT_TRUE(fs::exists(dir + "/notes.txt"));
}

TEST_F(TensorBoardWriterTest, FreshRunRemovesEarlierPoints) {
  const std::string dir = tmp_ + "/tb";
  run(dir, -1, 1, 4, 0);
  fs::create_directories(dir + "/other-run");  // subfolders are other runs: left alone
  std::ofstream(dir + "/other-run/events.out.tfevents.1.x") << "x";
  run(dir, -1, 1, 2, 0);
  EXPECT_EQ(event_files(dir).size(), 1u);
  EXPECT_EQ(points(dir).at("train/loss").size(), 2u);
  EXPECT_TRUE(fs::exists(dir + "/other-run/events.out.tfevents.1.x"));
}

TEST_F(TensorBoardWriterTest, FolderThatCannotBeCreatedIsAUsageError) {
  std::ofstream(tmp_ + "/file") << "x";
  for (const std::string& dir : {tmp_ + "/file", tmp_ + "/file/sub"}) {
    try {
      TensorBoardWriter tb(dir, true, -1);
      ADD_FAILURE() << "no error for " << dir;
    } catch (const UsageError& e) {
      EXPECT_NE(std::string(e.what()).find("cannot write train.tensorboard_dir '" + dir + "': Not a directory"),
                std::string::npos)
          << e.what();
    }
  }
}

// A full disk, played by a file size limit: the failed write names the file and the OS error.
TEST_F(TensorBoardWriterTest, FailedWriteIsAnInputError) {
  TensorBoardWriter tb(tmp_ + "/tb", true, -1);
  rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit small = old;
  small.rlim_cur = fs::file_size(tb.path()) + 10;
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  std::string message;
  try {
    tb.scalar("train/loss", 1, 1.0);
    tb.flush();
  } catch (const InputError& e) {
    message = e.what();
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(message, "cannot write TensorBoard event file '" + tb.path() + "': " + std::strerror(EFBIG));
}

}  // namespace
}  // namespace shardtrain
