// Unit tests of src/data/: token files, the sampler, the synthetic corpus and the data commands.
// Oracles are independent of the code under test: token files are built byte by byte here, the
// permutation is checked with a naive "seen" table, and data with token i == f(i) encodes its
// own expected values. Every test works in its own mkdtemp folder, removed afterwards.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "data/data_commands.hpp"
#include "data/dataset.hpp"
#include "data/sampler.hpp"
#include "data/synth.hpp"
#include "data/token_file.hpp"
#include "model/batch.hpp"

namespace shardtrain {
namespace {

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char name[] = "/tmp/shardtrain_test_data_XXXXXX";
    ASSERT_NE(mkdtemp(name), nullptr) << std::strerror(errno);
    dir_ = name;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The format spelled out independently: 256 little-endian int32 then the uint16 tokens.
std::string token_file_bytes(int32_t magic, int32_t version, int32_t count, const std::vector<uint16_t>& tokens) {
  std::string bytes(1024, '\0');
  const int32_t head[3] = {magic, version, count};
  for (int i = 0; i < 3; i++)
    for (int b = 0; b < 4; b++) bytes[4 * i + b] = static_cast<char>((static_cast<uint32_t>(head[i]) >> (8 * b)) & 255);
  for (uint16_t t : tokens) bytes += std::string{static_cast<char>(t & 255), static_cast<char>(t >> 8)};
  return bytes;
}

// Runs `body`, expecting a DataError whose message names `file` and contains `what`.
void expect_data_error(const std::function<void()>& body, const std::string& file, const std::string& what) {
  try {
    body();
    ADD_FAILURE() << "no DataError; expected one mentioning '" << what << "'";
  } catch (const DataError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(file), std::string::npos) << message;
    EXPECT_NE(message.find(what), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << "one line: " << message;
  }
}

std::vector<uint16_t> awkward_tokens(size_t n) {
  std::vector<uint16_t> tokens(n);
  for (size_t i = 0; i < n; i++) tokens[i] = static_cast<uint16_t>((i * 40503u + 7) % 65536);
  if (n > 2) tokens[0] = 0, tokens[1] = 65535, tokens[2] = 256;
  return tokens;
}

// ---- token files ----

TEST_F(DataTest, TokenFileRoundTripMatchesIndependentLayout) {
  const std::vector<uint16_t> tokens = awkward_tokens(1001);
  write_token_file(path("a.bin"), tokens);
  EXPECT_EQ(read_bytes(path("a.bin")), token_file_bytes(20240520, 1, 1001, tokens));
  EXPECT_FALSE(std::filesystem::exists(path("a.bin.tmp")));
  TokenFile file(path("a.bin"));
  EXPECT_EQ(file.path(), path("a.bin"));
  ASSERT_EQ(file.num_tokens(), tokens.size());
  for (size_t i = 0; i < tokens.size(); i++) ASSERT_EQ(file.token(i), tokens[i]) << i;
  TokenFile moved(std::move(file));  // move-only: the mapping travels, the source is empty
  EXPECT_EQ(moved.num_tokens(), tokens.size());
  EXPECT_EQ(moved.token(1), 65535u);
  EXPECT_EQ(file.num_tokens(), 0u);
}

// The loss mask after the tokens: flag 1 in header int 3, bit i % 8 of byte i / 8 set for a trained
// token, laid out here byte by byte; a dataset's targets are IGNORED_TARGET where the bit is clear.
TEST_F(DataTest, LossMaskRoundTripMatchesIndependentLayout) {
  const std::vector<uint16_t> narrow = awkward_tokens(21);
  const std::vector<uint32_t> tokens(narrow.begin(), narrow.end());
  std::vector<uint8_t> trained(tokens.size());
  for (size_t i = 0; i < trained.size(); i++) trained[i] = (i * 7 + 3) % 5 < 2;
  write_token_file(path("m.bin"), tokens.data(), tokens.size(), 2, trained.data());
  std::string expected = token_file_bytes(20240520, 1, 21, narrow);
  expected[12] = 1;  // the flag
  for (size_t byte = 0; byte < 3; byte++) {
    int bits = 0;
    for (size_t bit = 0; bit < 8 && byte * 8 + bit < trained.size(); bit++) bits |= trained[byte * 8 + bit] << bit;
    expected += static_cast<char>(bits);
  }
  EXPECT_EQ(read_bytes(path("m.bin")), expected);
  TokenFile file(path("m.bin"));
  ASSERT_TRUE(file.has_loss_mask());
  for (size_t i = 0; i < tokens.size(); i++) ASSERT_EQ(file.trained(i), trained[i] != 0) << i;
  TokenDataset data("data.train_file", path("m.bin"), 4);
  ASSERT_TRUE(data.masks_targets());
  ASSERT_EQ(data.windows(), 5u);
  for (uint64_t w = 0; w < data.windows(); w++) {
    int inputs[4], targets[4];
    data.fill(w, inputs, targets);
    uint64_t counted = 0;
    for (size_t t = 0; t < 4; t++) {
      const size_t at = w * 4 + t + 1;
      EXPECT_EQ(targets[t], trained[at] ? static_cast<int>(tokens[at]) : IGNORED_TARGET) << w << " " << t;
      counted += trained[at];
    }
    EXPECT_EQ(data.trained_targets(w), counted) << w;
  }
  write_token_file(path("plain.bin"), tokens.data(), tokens.size(), 2);
  EXPECT_FALSE(TokenFile(path("plain.bin")).has_loss_mask());
  EXPECT_FALSE(TokenDataset("data.train_file", path("plain.bin"), 4).masks_targets());
}

// data.documents: each position's document starts at the last document-start token at or before
// it in the window, or at the window's start.
TEST_F(DataTest, DocumentStartsComeFromTheStartToken) {
  const std::vector<uint16_t> tokens = {7, 1, 2, 7, 3, 7, 7, 4, 5, 6, 1, 2, 3};
  write_token_file(path("d.bin"), tokens);
  TokenDataset data("data.train_file", path("d.bin"), 6);
  data.set_document_start(7);
  Batch batch;
  data.begin(batch, 2);
  data.fill(batch, 0, 0, 0, false);
  data.fill(batch, 1, 1, 1, false);
  const int* starts = batch.get<int>(BATCH_DOC_STARTS, 12);
  const std::vector<int> expected = {0, 0, 0, 3, 3, 5,   // window 0: tokens 7 1 2 7 3 7
                                     0, 0, 0, 0, 0, 0};  // window 1: tokens 7 4 5 6 1 2
  EXPECT_EQ(std::vector<int>(starts, starts + 12), expected);
  TokenDataset plain("data.train_file", path("d.bin"), 6);
  Batch unpacked;
  plain.begin(unpacked, 2);
  EXPECT_FALSE(unpacked.has(BATCH_DOC_STARTS));
}

TEST_F(DataTest, TokenFileWithNoTokensIsValid) {
  write_token_file(path("empty.bin"), {});
  TokenFile file(path("empty.bin"));
  EXPECT_EQ(file.num_tokens(), 0u);
  EXPECT_EQ(file.max_token_in(0, 0), 0u);
}

struct BadFileCase {
  const char* name;
  std::function<void(const std::string&)> make;  // writes the broken file at the path
  const char* expected;                           // a phrase the message must contain
};

class TokenFileErrors : public ::testing::TestWithParam<BadFileCase> {};

TEST_P(TokenFileErrors, NamesTheFileAndTheProblem) {
  char name[] = "/tmp/shardtrain_test_data_XXXXXX";
  ASSERT_NE(mkdtemp(name), nullptr);
  const std::string file = std::string(name) + "/broken_file.bin";
  GetParam().make(file);
  expect_data_error([&] { TokenFile f(file); }, file, GetParam().expected);
  std::filesystem::remove_all(name);
}

const std::vector<uint16_t> FIVE = {1, 2, 3, 4, 5};
INSTANTIATE_TEST_SUITE_P(
    Data, TokenFileErrors,
    ::testing::Values(
        BadFileCase{"missing", [](const std::string&) {}, "cannot open"},
        BadFileCase{"empty_file", [](const std::string& p) { write_bytes(p, ""); }, "shorter than the 1024-byte header"},
        BadFileCase{"short_header", [](const std::string& p) { write_bytes(p, token_file_bytes(20240520, 1, 0, {}).substr(0, 1023)); },
                    "shorter than the 1024-byte header"},
        BadFileCase{"bad_magic", [](const std::string& p) { write_bytes(p, token_file_bytes(123, 1, 5, FIVE)); }, "bad magic 123"},
        BadFileCase{"bad_version", [](const std::string& p) { write_bytes(p, token_file_bytes(20240520, 2, 5, FIVE)); },
                    "unsupported version 2"},
        BadFileCase{"truncated", [](const std::string& p) { write_bytes(p, token_file_bytes(20240520, 1, 6, FIVE)); }, "truncated"},
        BadFileCase{"half_token", [](const std::string& p) { write_bytes(p, token_file_bytes(20240520, 1, 5, FIVE).substr(0, 1033)); },
                    "truncated"},
        BadFileCase{"trailing", [](const std::string& p) { write_bytes(p, token_file_bytes(20240520, 1, 4, FIVE)); }, "trailing bytes"},
        BadFileCase{"mask_truncated",
                    [](const std::string& p) {
                      std::string bytes = token_file_bytes(20240520, 1, 5, FIVE);
                      bytes[12] = 1;  // a loss mask is announced, its byte is missing
                      write_bytes(p, bytes);
                    },
                    "and a loss mask"},
        BadFileCase{"unknown_flag",
                    [](const std::string& p) {
                      std::string bytes = token_file_bytes(20240520, 1, 5, FIVE);
                      bytes[12] = 2;
                      write_bytes(p, bytes);
                    },
                    "unknown flags 2"},
        BadFileCase{"negative_count", [](const std::string& p) { write_bytes(p, token_file_bytes(20240520, 1, -5, FIVE)); },
                    "negative token count"},
        BadFileCase{"directory", [](const std::string& p) { std::filesystem::create_directory(p); }, "not a regular file"}),
    [](const ::testing::TestParamInfo<BadFileCase>& info) { return std::string(info.param.name); });

TEST_F(DataTest, WriteTokenFileIntoMissingFolderFails) {
  const std::string file = path("no_such_folder/x.bin");
  expect_data_error([&] { write_token_file(file, {1, 2}); }, file, "cannot create");
}

TEST_F(DataTest, MaxTokenInMatchesNaiveScan) {
  const std::vector<uint16_t> tokens = awkward_tokens(777);
  write_token_file(path("t.bin"), tokens);
  TokenFile file(path("t.bin"));
  for (size_t begin : {0, 1, 3, 100, 776})
    for (size_t end : {begin, begin + 1, size_t(500), size_t(777)}) {
      if (end < begin || end > 777) continue;
      uint32_t naive = 0;
      for (size_t i = begin; i < end; i++) naive = std::max<uint32_t>(naive, tokens[i]);
      EXPECT_EQ(file.max_token_in(begin, end), naive) << begin << ".." << end;
    }
}

TEST_F(DataTest, CheckTokenRangeFindsOffenderInExactlyItsPart) {
  std::vector<uint16_t> tokens(1000);
  for (size_t i = 0; i < tokens.size(); i++) tokens[i] = static_cast<uint16_t>(i % 256);  // all < 256, 255 included
  tokens[617] = 256;  // the smallest bad value, at an index no split aligns with
  write_token_file(path("bad_vocab.bin"), tokens);
  TokenFile file(path("bad_vocab.bin"));
  EXPECT_EQ(check_token_range(file, 257, 0, 1), "");
  for (int parts = 1; parts <= 7; parts++) {
    int reports = 0;
    for (int part = 0; part < parts; part++) {
      const std::string message = check_token_range(file, 256, part, parts);
      if (message.empty()) continue;
      reports++;
      for (const char* needle : {"bad_vocab.bin", "token 256", "index 617", "vocab_size=256"})
        EXPECT_NE(message.find(needle), std::string::npos) << message;
    }
    EXPECT_EQ(reports, 1) << parts << " parts";
  }
}

// ---- sampler ----

TEST(Sampler, PermutationIsBijectiveForAwkwardSizes) {
  for (uint64_t n : {1, 2, 3, 7, 1000, 1023, 1024, 1025})
    for (uint64_t key : {0ull, 1ull, 0xdeadbeefull}) {
      const WindowPermutation perm(n, key);
      std::vector<bool> seen(n, false);
      for (uint64_t p = 0; p < n; p++) {
        const uint64_t w = perm(p);
        ASSERT_LT(w, n);
        ASSERT_FALSE(seen[w]) << "n=" << n << " key=" << key << " repeats " << w;
        seen[w] = true;
      }
    }
}

TEST(Sampler, PermutationLooksShuffled) {
  const WindowPermutation a(1000, 1), b(1000, 2);
  int fixed = 0, same = 0;
  for (uint64_t p = 0; p < 1000; p++) fixed += a(p) == p, same += a(p) == b(p);
  EXPECT_LT(fixed, 20);  // a random permutation has 1 fixed point on average
  EXPECT_LT(same, 20);
}

// Windows of one whole epoch, in global sequence order g = step * G + j.
std::vector<uint64_t> epoch_windows(const SequenceSampler& s, uint64_t epoch) {
  std::vector<uint64_t> windows;
  const uint64_t G = s.global_batch();
  for (uint64_t g = epoch * s.windows(); g < (epoch + 1) * s.windows(); g++) windows.push_back(s.window(g / G, g % G));
  return windows;
}

TEST(Sampler, EachEpochVisitsEveryWindowOnce) {
  for (uint64_t W : {1, 2, 3, 7, 1000, 1023, 1025}) {
    const int G = W >= 3 ? 3 : 1;
    SequenceSampler s(42, W, G);
    ASSERT_EQ(s.windows(), W);
    for (uint64_t epoch : {0, 1, 5}) {
      std::vector<bool> seen(W, false);
      for (uint64_t w : epoch_windows(s, epoch)) {
        ASSERT_LT(w, W);
        ASSERT_FALSE(seen[w]);
        seen[w] = true;
      }
    }
  }
}

TEST(Sampler, DependsOnlyOnSeedStepAndSequence) {
  const SequenceSampler a(7, 6250, 24), b(7, 6250, 24);
  // Random access in any order (as ranks of any world size ask) gives the same answer.
  std::vector<uint64_t> forward;
  for (uint64_t step = 0; step < 600; step++)
    for (uint64_t j = 0; j < 24; j++) forward.push_back(a.window(step, j));
  for (uint64_t step = 600; step-- > 0;)
    for (uint64_t j = 24; j-- > 0;) ASSERT_EQ(b.window(step, j), forward[step * 24 + j]);
  // Any split into ranks x micro-batches x accumulation covers the step's sequences exactly once.
  for (int ranks : {1, 2, 3, 4}) {
    const int micro = 2, accum = 24 / (micro * ranks);
    if (accum * micro * ranks != 24) continue;
    std::vector<int> hits(24, 0);
    for (int m = 0; m < accum; m++)
      for (int r = 0; r < ranks; r++)
        for (int i = 0; i < micro; i++) hits[(m * ranks + r) * micro + i]++;
    EXPECT_EQ(hits, std::vector<int>(24, 1)) << ranks << " ranks";
  }
  const SequenceSampler other_seed(8, 6250, 24);
  int same = 0;
  for (uint64_t j = 0; j < 24; j++) same += other_seed.window(0, j) == forward[j];
  EXPECT_LT(same, 5);
}

TEST(Sampler, EpochsUseDifferentOrders) {
  const SequenceSampler s(3, 1000, 10);
  EXPECT_EQ(s.epoch_of(0), 0);
  EXPECT_EQ(s.epoch_of(99), 0);
  EXPECT_EQ(s.epoch_of(100), 1);
  EXPECT_EQ(s.epoch_of(250), 2);
  const std::vector<uint64_t> e0 = epoch_windows(s, 0), e1 = epoch_windows(s, 1), e2 = epoch_windows(s, 2);
  EXPECT_NE(e0, e1);
  EXPECT_NE(e1, e2);
  EXPECT_EQ(s.window(100, 0), e1[0]);  // step 100 starts epoch 1
}

TEST(Sampler, OrderIsTheOneOfEarlierReleases) {
  // Windows of steps 0, 1 and 57 (global batch 8) over 1000 windows with seed 1337, as the sampler
  // of the single-file releases computed them (window_start / seq_len): runs and checkpoints of
  // those releases continue on the same data.
  const SequenceSampler s(1337, 1000, 8);
  const uint64_t expected[3][8] = {{376, 574, 448, 606, 690, 455, 38, 624},
                                   {732, 787, 321, 698, 554, 811, 857, 965},
                                   {950, 599, 577, 158, 256, 21, 850, 148}};
  const uint64_t steps[3] = {0, 1, 57};
  for (int i = 0; i < 3; i++)
    for (uint64_t j = 0; j < 8; j++) EXPECT_EQ(s.window(steps[i], j), expected[i][j]) << steps[i] << " " << j;
}

// ---- synthetic corpus ----

TEST(Synth, DeterministicAsciiOfExactSize) {
  const std::string a = synth_corpus(7, 50000);
  EXPECT_EQ(a, synth_corpus(7, 50000));
  EXPECT_NE(a, synth_corpus(8, 50000));
  EXPECT_EQ(synth_corpus(7, 1234), a.substr(0, 1234));
  for (size_t n : {0, 1, 17, 4099}) EXPECT_EQ(synth_corpus(3, n).size(), n);
  for (unsigned char c : a) ASSERT_TRUE(c == '\n' || (c >= 32 && c < 127)) << int(c);
}

// A character trigram model fitted on one seed and scored on another: an upper bound, reachable
// by a tiny model, on the loss a transformer can get. It must be far below ln(256) = 5.55.
TEST(Synth, LearnableByATrigramModel) {
  const std::string train = synth_corpus(1, 400000), test = synth_corpus(2, 100000);
  std::map<std::string, std::vector<double>> counts;
  for (size_t i = 2; i < train.size(); i++) {
    auto& row = counts[train.substr(i - 2, 2)];
    if (row.empty()) row.assign(129, 0.0);  // 128 symbols + the row total
    row[static_cast<unsigned char>(train[i])] += 1, row[128] += 1;
  }
  const double alpha = 0.01;  // add-alpha smoothing over 128 symbols
  double nats = 0;
  for (size_t i = 2; i < test.size(); i++) {
    auto it = counts.find(test.substr(i - 2, 2));
    const double hit = it == counts.end() ? 0 : it->second[static_cast<unsigned char>(test[i])];
    const double total = it == counts.end() ? 0 : it->second[128];
    nats -= std::log((hit + alpha) / (total + 128 * alpha));
  }
  const double per_byte = nats / static_cast<double>(test.size() - 2);
  EXPECT_LT(per_byte, 2.0);
  const double entropy = synth_corpus_entropy(1, 400000);
  EXPECT_GT(entropy, 0.2);  // not degenerate
  EXPECT_LT(entropy, per_byte);
}

// ---- data commands ----

TEST_F(DataTest, EncodeRoundTripsEveryByteValue) {
  std::string text;
  for (int i = 0; i < 1001; i++) text += static_cast<char>((i * 7) % 256);
  write_bytes(path("in.txt"), text);
  data_encode(path("in.txt"), path("corpus_train.bin"), 0.1);
  TokenFile train(path("corpus_train.bin")), val(path("corpus_val.bin"));
  ASSERT_EQ(train.num_tokens(), 901u);  // floor(1001 * 0.1) = 100 bytes of validation
  ASSERT_EQ(val.num_tokens(), 100u);
  std::string back;
  for (size_t i = 0; i < 901; i++) back += static_cast<char>(train.token(i));
  for (size_t i = 0; i < 100; i++) back += static_cast<char>(val.token(i));
  EXPECT_EQ(back, text);
  EXPECT_EQ(check_token_range(train, 256, 0, 1), "");
  data_encode(path("in.txt"), path("all.bin"), 0.0);
  EXPECT_EQ(TokenFile(path("all.bin")).num_tokens(), 1001u);
  EXPECT_FALSE(std::filesystem::exists(path("all_val.bin")));
}

TEST(DataCommands, ValPathRule) {
  EXPECT_EQ(val_path_for("d/x_train.bin"), "d/x_val.bin");
  EXPECT_EQ(val_path_for("d/x.bin"), "d/x_val.bin");
  EXPECT_EQ(val_path_for("d/x.tok"), "d/x.tok_val.bin");
}

TEST_F(DataTest, EncodeErrorsNameTheFile) {
  expect_data_error([&] { data_encode(path("nope.txt"), path("o.bin"), 0.1); }, "nope.txt", "does not exist");
  write_bytes(path("empty.txt"), "");
  expect_data_error([&] { data_encode(path("empty.txt"), path("o.bin"), 0.1); }, "empty.txt", "empty");
  write_bytes(path("tiny.txt"), "abc");
  expect_data_error([&] { data_encode(path("tiny.txt"), path("o.bin"), 0.1); }, "tiny.txt", "too small");
  // A folder that cannot be made (a file is in the way) is named before anything is encoded; a
  // missing one is made.
  expect_data_error([&] { data_encode(path("tiny.txt"), path("tiny.txt/sub/o.bin"), 0.0); }, "tiny.txt/sub/o.bin",
                    "cannot create its folder");
  ::testing::internal::CaptureStdout();
  data_encode(path("tiny.txt"), path("missing/o.bin"), 0.0);
  ::testing::internal::GetCapturedStdout();
  EXPECT_TRUE(std::filesystem::exists(path("missing/o.bin")));
  EXPECT_THROW(data_encode(path("tiny.txt"), path("o.bin"), 1.0), UsageError);
  EXPECT_THROW(data_encode(path("tiny.txt"), path("o.bin"), -0.5), UsageError);
}

TEST_F(DataTest, SynthWritesTrainAndValFromDifferentSeeds) {
  const std::string out = path("nested/data");
  ::testing::internal::CaptureStdout();
  data_synth(out, 5, 3000, 700);
  const std::string printed = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(printed.find(out + "/synth_train.bin: 3000 tokens"), std::string::npos) << printed;
  EXPECT_NE(printed.find(out + "/synth_val.bin: 700 tokens"), std::string::npos) << printed;
  TokenFile train(out + "/synth_train.bin"), val(out + "/synth_val.bin");
  ASSERT_EQ(train.num_tokens(), 3000u);
  ASSERT_EQ(val.num_tokens(), 700u);
  EXPECT_LT(train.max_token_in(0, 3000), 128u);
  const std::string expected = synth_corpus(5, 3000);
  std::string got, val_text;
  for (size_t i = 0; i < 3000; i++) got += static_cast<char>(train.token(i));
  for (size_t i = 0; i < 700; i++) val_text += static_cast<char>(val.token(i));
  EXPECT_EQ(got, expected);
  EXPECT_NE(val_text, expected.substr(0, 700));
  write_bytes(path("a_file"), "x");
  expect_data_error([&] { data_synth(path("a_file"), 5, 10, 10); }, "a_file", "cannot create");
}

}  // namespace
}  // namespace shardtrain
