// utf8_complete_prefix, which lets `generate` write each token's text as it comes: bytes written in
// pieces cut there, each piece through utf8_with_replacements, must give exactly the text of the
// whole (the oracle: utf8_with_replacements of all the bytes at once, tested against CPython in
// test_tokenizer.cpp), whatever the cuts; and nothing complete may be held back.
#include <gtest/gtest.h>

#include <algorithm>
#include <iterator>
#include <random>
#include <string>

#include "data/tokenizer.hpp"

namespace shardtrain {
namespace {

// The bytes arriving in `pieces`, written as generate writes them; `held` is the most ever held.
std::string streamed(const std::vector<std::string>& pieces, size_t* held = nullptr) {
  std::string pending, out;
  for (const std::string& piece : pieces) {
    pending += piece;
    const size_t complete = utf8_complete_prefix(pending);
    out += utf8_with_replacements(pending.substr(0, complete));
    pending.erase(0, complete);
    if (held) *held = std::max(*held, pending.size());
  }
  return out + utf8_with_replacements(pending);
}

TEST(Utf8Stream, HoldsOnlyAnIncompleteCharacter) {
  EXPECT_EQ(utf8_complete_prefix(""), 0u);
  EXPECT_EQ(utf8_complete_prefix("abc"), 3u);
  EXPECT_EQ(utf8_complete_prefix("a\xE2\x82\xAC"), 4u);       // a whole euro sign
  EXPECT_EQ(utf8_complete_prefix("a\xE2\x82"), 1u);           // its first two bytes wait
  EXPECT_EQ(utf8_complete_prefix("a\xE2"), 1u);
  EXPECT_EQ(utf8_complete_prefix("\xF0\x9F\x98"), 0u);        // three bytes of an emoji
  EXPECT_EQ(utf8_complete_prefix("\xE0\x80"), 2u);            // E0 needs A0..BF next: already invalid
  EXPECT_EQ(utf8_complete_prefix("\xED\xA0"), 2u);            // a surrogate: invalid
  EXPECT_EQ(utf8_complete_prefix("\xF4\x90"), 2u);            // beyond U+10FFFF: invalid
  EXPECT_EQ(utf8_complete_prefix("x\x80\x80"), 3u);           // stray continuation bytes
  EXPECT_EQ(utf8_complete_prefix("\xC0"), 1u);                // never a lead
  EXPECT_EQ(utf8_complete_prefix("\xF0\x9F\x98\x80\xF0"), 4u);
}

TEST(Utf8Stream, PiecesGiveTheWholeTextForAnyCuts) {
  // Bytes drawn to make every case common: ASCII, continuation bytes of each range, every kind of
  // lead, and bytes that are never valid.
  const unsigned char alphabet[] = {'a', ' ', '\n', 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC2, 0xDF,
                                    0xE0, 0xE1, 0xED, 0xEF, 0xF0, 0xF1, 0xF4, 0xF5, 0xFF};
  std::mt19937 rng(7);
  size_t most_held = 0;
  for (int trial = 0; trial < 20000; trial++) {
    std::string bytes;
    const int n = static_cast<int>(rng() % 12);
    for (int i = 0; i < n; i++) bytes += static_cast<char>(alphabet[rng() % sizeof alphabet]);
    std::vector<std::string> pieces;
    for (size_t at = 0; at < bytes.size();) {
      const size_t len = std::min<size_t>(bytes.size() - at, rng() % 4);  // empty pieces too
      pieces.push_back(bytes.substr(at, len));
      at += len;
    }
    ASSERT_EQ(streamed(pieces, &most_held), utf8_with_replacements(bytes)) << "trial " << trial;
  }
  EXPECT_EQ(most_held, 3u);  // at most a four-byte character's first three
}

TEST(Utf8Stream, ValidTextIsHeldOnlyInsideACharacter) {
  const std::string text = "a\xC3\xA9\xE2\x82\xAC \xF0\x9F\x98\x80z";
  const std::vector<size_t> boundaries = {0, 1, 3, 6, 7, 11, 12};
  for (size_t end = 0; end <= text.size(); end++) {
    const size_t start = *std::prev(std::upper_bound(boundaries.begin(), boundaries.end(), end));
    EXPECT_EQ(utf8_complete_prefix(text.substr(0, end)), start) << end;  // the last character's start, or all
  }
}

}  // namespace
}  // namespace shardtrain
