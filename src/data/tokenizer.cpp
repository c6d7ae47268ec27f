// tokenizer.json loading and the encode pipeline, in the reference's order: added tokens that are
// not normalized are cut out of the raw text; each remaining piece is normalized (NFC) and the
// normalized added tokens are cut out of it; each remaining piece is pre-tokenized (Split regexes,
// then ByteLevel) into words; each word is BPE-encoded (cached); the post-processor's template
// wraps the result.
#include "data/tokenizer.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <unordered_map>
#include <unordered_set>

#include "core/error.hpp"
#include "core/format.hpp"
#include "data/bpe.hpp"
#include "data/token_file.hpp"

namespace shardtrain {
namespace {

// A UTF-8 lead byte's continuation bytes (0 for no lead) and the range its first continuation
// byte must lie in: Unicode's table of well-formed sequences.
struct Utf8Lead {
  int need;
  unsigned lo, hi;
};
Utf8Lead utf8_lead(unsigned lead) {
  if (lead >= 0xC2 && lead <= 0xDF) return {1, 0x80, 0xBF};
  if (lead == 0xE0) return {2, 0xA0, 0xBF};
  if (lead == 0xED) return {2, 0x80, 0x9F};
  if (lead >= 0xE1 && lead <= 0xEF) return {2, 0x80, 0xBF};
  if (lead == 0xF0) return {3, 0x90, 0xBF};
  if (lead == 0xF4) return {3, 0x80, 0x8F};
  if (lead >= 0xF1 && lead <= 0xF3) return {3, 0x80, 0xBF};
  return {0, 0x80, 0xBF};
}

}  // namespace

using nlohmann::json;

std::string utf8_with_replacements(std::string_view bytes) {
  static const char kReplacement[] = "\xEF\xBF\xBD";
  std::string out;
  out.reserve(bytes.size());
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  size_t i = 0;
  while (i < n) {
    const size_t run = i;
    while (i < n && b[i] < 0x80) i++;
    out.append(bytes.data() + run, i - run);
    if (i == n) break;
    const auto [need, lo, hi] = utf8_lead(b[i]);
    size_t j = i + 1;
    int got = 0;
    while (got < need && j < n && b[j] >= (got == 0 ? lo : 0x80u) && b[j] <= (got == 0 ? hi : 0xBFu)) j++, got++;
    if (need > 0 && got == need) out.append(bytes.data() + i, j - i);
    else out.append(kReplacement, 3);  // one U+FFFD for the lead and the valid start it had
    i = j;
  }
  return out;
}

size_t utf8_complete_prefix(std::string_view bytes) {
  const auto* b = reinterpret_cast<const unsigned char*>(bytes.data());
  const size_t n = bytes.size();
  // The last byte that is no continuation byte; a sequence starts there if it is a lead.
  size_t lead_at = n;
  for (size_t back = 1; back <= std::min<size_t>(3, n); back++)
    if (b[n - back] < 0x80 || b[n - back] > 0xBF) {
      lead_at = n - back;
      break;
    }
  if (lead_at == n) return n;
  const auto [need, lo, hi] = utf8_lead(b[lead_at]);
  const size_t got = n - lead_at - 1;
  if (got >= static_cast<size_t>(need)) return n;  // complete, or no lead at all
  if (got >= 1 && (b[lead_at + 1] < lo || b[lead_at + 1] > hi)) return n;  // already invalid
  return lead_at;
}

std::string json_error_text(const char* what) {
  const std::string text = what;
  const size_t tag_end = text.rfind("] ", text.find("parse error"));
  return text.compare(0, 16, "[json.exception.") == 0 && tag_end != std::string::npos ? text.substr(tag_end + 2) : text;
}

namespace {

// ---- PCRE2 --------------------------------------------------------------------------------------

// tokenizers runs its regexes on Oniguruma with Ruby's syntax, where PCRE2 (UTF, UCP) differs:
// \s is Unicode's White_Space (PCRE2's also takes U+180E); \w is Alphabetic, marks, decimal digits
// and connector punctuation (PCRE2's: letters, numbers, "_"), outside a class also the Latin-1
// superscripts and fractions ²³¹¼½¾ (Oniguruma's Latin-1 table; the reference agrees, measured);
// \h is a hex digit (PCRE2's: horizontal space); \b and \B follow \w; the inline option m means
// "dot matches newline" (PCRE2's s); ^ and $ always match at line ends (PCRE2_MULTILINE, set when
// compiling). Rewriting these with Unicode properties gives Oniguruma's meaning with PCRE2's own
// tables. Inside a character class \W and \H keep PCRE2's meaning (a negated class has no
// spelling there).
std::string oniguruma_to_pcre2(const std::string& pattern) {
  static const char* const kWord = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}";
  const std::string word_chars = std::string(kWord) + "\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}";
  const std::string word = "[" + word_chars + "]";
  std::string out;
  int depth = 0;  // inside [...] (Oniguruma nests classes)
  for (size_t i = 0; i < pattern.size(); i++) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char d = pattern[++i];
      const bool inside = depth > 0;
      if (d == 's') out += inside ? "\\p{White_Space}" : "[\\p{White_Space}]";
      else if (d == 'S') out += "\\P{White_Space}";
      else if (d == 'w') out += inside ? kWord : word;
      else if (d == 'W' && !inside) out += "[^" + word_chars + "]";
      else if (d == 'h') out += inside ? "0-9a-fA-F" : "[0-9a-fA-F]";
      else if (d == 'H' && !inside) out += "[^0-9a-fA-F]";
      else if (d == 'b' && !inside) out += "(?:(?<=" + word + ")(?!" + word + ")|(?<!" + word + ")(?=" + word + "))";
      else if (d == 'B' && !inside) out += "(?:(?<=" + word + ")(?=" + word + ")|(?<!" + word + ")(?!" + word + "))";
      else out += {c, d};
      continue;
    }
    if (depth == 0 && c == '(' && pattern.compare(i, 2, "(?") == 0) {  // (?imx-imx) or (?imx-imx:
      size_t k = i + 2;
      while (k < pattern.size() && std::strchr("imx-", pattern[k]) != nullptr) k++;
      if (k > i + 2 && k < pattern.size() && (pattern[k] == ')' || pattern[k] == ':')) {
        for (size_t f = i; f < k; f++) out += pattern[f] == 'm' ? 's' : pattern[f];
        i = k - 1;
        continue;
      }
    }
    if (c == '[') depth++;
    else if (c == ']' && depth > 0) depth--;
    out += c;
  }
  return out;
}

// The offset of the UTF-8 character after the one at `pos`.
size_t next_char(std::string_view text, size_t pos) {
  pos++;
  while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80) pos++;
  return pos;
}

class Regex {
 public:
  // Throws DataError(where + the compiler's message) on a bad pattern.
  Regex(const std::string& pattern, bool literal, const std::string& where) : where_(where), pattern_(pattern) {
    int code = 0;
    PCRE2_SIZE offset = 0;
    const std::string compiled = literal ? pattern : oniguruma_to_pcre2(pattern);
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(compiled.data()), compiled.size(),
                          // LITERAL takes UTF but not UCP (which only changes what classes mean)
                          literal ? PCRE2_UTF | PCRE2_LITERAL : PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &code,
                          &offset, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(code, message, sizeof message);
      throw DataError(where + strprintf(": regex does not compile at pattern offset %zu: %s", offset,
                                        reinterpret_cast<const char*>(message)));
    }
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // without JIT, pcre2_match interprets: same results
    match_ = pcre2_match_data_create_from_pattern(code_, nullptr);
    context_ = pcre2_match_context_create(nullptr);
    stack_ = pcre2_jit_stack_create(32 << 10, 64 << 20, nullptr);  // long whitespace runs backtrack deep
    pcre2_jit_stack_assign(context_, nullptr, stack_);
  }
  ~Regex() {
    pcre2_jit_stack_free(stack_);
    pcre2_match_context_free(context_);
    pcre2_match_data_free(match_);
    pcre2_code_free(code_);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Calls emit(piece) for every match and every non-empty gap between matches, in order (Split's
  // "Isolated" behaviour). An empty match only separates the text around it.
  template <class Emit>
  void split_isolated(std::string_view text, Emit&& emit) const {
    size_t done = 0, from = 0;
    while (from <= text.size()) {
      size_t begin = 0, end = 0;
      if (!find(text, from, 0, begin, end)) break;
      if (begin > done) emit(text.substr(done, begin - done));
      if (end > begin) emit(text.substr(begin, end - begin));
      done = end;
      from = end > begin ? end : next_char(text, end);
    }
    if (done < text.size()) emit(text.substr(done));
  }

  // Whether the pattern matches at exactly `pos`.
  bool matches_at(std::string_view text, size_t pos) const {
    size_t begin = 0, end = 0;
    return find(text, pos, PCRE2_ANCHORED, begin, end);
  }

 private:
  bool find(std::string_view text, size_t from, uint32_t options, size_t& begin, size_t& end) const {
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), from,
                               options | PCRE2_NO_UTF_CHECK, match_, context_);
    if (rc == PCRE2_ERROR_NOMATCH) return false;
    if (rc < 0) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(rc, message, sizeof message);
      throw DataError(strprintf("%s: the regex '%s' failed on a text of %zu bytes: %s (a pattern that backtracks "
                                "this deeply cannot split such a text; simplify the pattern or split the text)",
                                where_.c_str(), printable_text(pattern_, 120).c_str(), text.size(),
                                reinterpret_cast<const char*>(message)));
    }
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(match_);
    begin = ovector[0];
    end = ovector[1];
    return true;
  }

  std::string where_, pattern_;  // for the messages
  pcre2_code* code_ = nullptr;
  pcre2_match_data* match_ = nullptr;
  pcre2_match_context* context_ = nullptr;
  pcre2_jit_stack* stack_ = nullptr;
};

// GPT-2's split pattern, ByteLevel's own when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- byte level ---------------------------------------------------------------------------------

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes for
// U+0100.. in byte order. Returns each byte's character as UTF-8.
std::vector<std::string> byte_level_chars() {
  std::vector<std::string> chars(256);
  uint32_t extra = 256;
  for (int b = 0; b < 256; b++) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : extra++;
    utf8proc_uint8_t buf[4];
    const utf8proc_ssize_t len = utf8proc_encode_char(static_cast<utf8proc_int32_t>(cp), buf);
    chars[b].assign(reinterpret_cast<const char*>(buf), static_cast<size_t>(len));
  }
  return chars;
}

// ---- added tokens -------------------------------------------------------------------------------

struct AddedToken {
  std::string content;
  uint32_t id = 0;
  bool single_word = false, lstrip = false, rstrip = false, normalized = true, special = false;
};

// One piece of a split text: a token already decided (id) or text still to encode.
struct Piece {
  size_t begin, end;
  int64_t id;  // -1: text
};

// The classes the reference tests added tokens' options with: the Rust regex crate's \w (for
// single_word) and \s (for lstrip and rstrip).
struct CharClasses {
  Regex word{R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])", false, "word characters"};
  Regex space{R"(\p{White_Space})", false, "white space"};
};

size_t char_start_before(std::string_view text, size_t pos) {
  do pos--;
  while (pos > 0 && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80);
  return pos;
}

size_t char_end_after(std::string_view text, size_t pos) {
  do pos++;
  while (pos < text.size() && (static_cast<unsigned char>(text[pos]) & 0xC0) == 0x80);
  return pos;
}

// A set of added tokens matched leftmost-longest without overlaps (the reference's Aho-Corasick
// automaton), with their single_word / lstrip / rstrip options applied as the reference applies them.
class AddedTokenMatcher {
 public:
  void add(const AddedToken* token, std::string pattern) {
    if (pattern.empty()) return;
    entries_.push_back({token, std::move(pattern)});
  }
  void finish() {
    std::stable_sort(entries_.begin(), entries_.end(),
                     [](const Entry& a, const Entry& b) { return a.pattern.size() > b.pattern.size(); });
    for (size_t i = 0; i < entries_.size(); i++)
      by_first_byte_[static_cast<unsigned char>(entries_[i].pattern[0])].push_back(i);
  }
  bool empty() const { return entries_.empty(); }

  void split(std::string_view text, const CharClasses& classes, std::vector<Piece>& pieces) const {
    pieces.clear();
    size_t done = 0, pos = 0;
    while (pos < text.size()) {
      const Entry* hit = longest_at(text, pos);
      if (hit == nullptr) {
        pos++;
        continue;
      }
      size_t begin = pos, end = pos + hit->pattern.size();
      pos = end;  // the automaton moves on past every match, also one the options reject
      const AddedToken& t = *hit->token;
      if (t.single_word) {
        const bool word_before = begin > 0 && classes.word.matches_at(text, char_start_before(text, begin));
        const bool word_after = end < text.size() && classes.word.matches_at(text, end);
        if (word_before || word_after) continue;
      }
      if (t.lstrip) {
        size_t b = begin;
        while (b > 0 && classes.space.matches_at(text, char_start_before(text, b))) b = char_start_before(text, b);
        begin = std::max(b, done);  // spaces an earlier token already took stay with it
      }
      if (t.rstrip)
        while (end < text.size() && classes.space.matches_at(text, end)) end = char_end_after(text, end);
      if (done < begin) pieces.push_back({done, begin, -1});
      pieces.push_back({begin, end, t.id});
      done = end;
    }
    if (done < text.size()) pieces.push_back({done, text.size(), -1});
  }

 private:
  struct Entry {
    const AddedToken* token;
    std::string pattern;
  };
  const Entry* longest_at(std::string_view text, size_t pos) const {
    for (size_t i : by_first_byte_[static_cast<unsigned char>(text[pos])]) {
      const std::string& p = entries_[i].pattern;
      if (p.size() <= text.size() - pos && text.compare(pos, p.size(), p) == 0) return &entries_[i];
    }
    return nullptr;
  }
  std::vector<Entry> entries_;
  std::vector<size_t> by_first_byte_[256];
};

// ---- word cache ---------------------------------------------------------------------------------

// Raw word bytes -> its token ids: open addressing with the hash kept in the slot, keys and ids in
// two flat arrays, so a hit costs one probe and no allocation. It doubles up to kMaxSlots, then is
// emptied when full (bounded memory; the ids never depend on what is cached).
class WordCache {
 public:
  WordCache() : slots_(size_t{1} << 12) {}

  // The cached ids of `word`, or null.
  const uint32_t* find(std::string_view word, uint64_t hash, uint32_t& count) const {
    const size_t mask = slots_.size() - 1;
    for (size_t i = hash & mask;; i = (i + 1) & mask) {
      const Slot& s = slots_[i];
      if (s.key_len == kEmpty) return nullptr;
      if (s.hash == hash && s.key_len == word.size() && keys_.compare(s.key_at, s.key_len, word) == 0) {
        count = s.ids_len;
        return ids_.data() + s.ids_at;
      }
    }
  }

  void insert(std::string_view word, uint64_t hash, const uint32_t* ids, size_t count) {
    if (used_ >= slots_.size() / 2) grow();
    if (keys_.size() + word.size() > UINT32_MAX || ids_.size() + count > UINT32_MAX) clear();
    place(Slot{hash, static_cast<uint32_t>(keys_.size()), static_cast<uint32_t>(word.size()),
               static_cast<uint32_t>(ids_.size()), static_cast<uint32_t>(count)});
    keys_.append(word);
    ids_.insert(ids_.end(), ids, ids + count);
  }

 private:
  static constexpr size_t kMaxSlots = size_t{1} << 22;
  static constexpr uint32_t kEmpty = UINT32_MAX;
  struct Slot {
    uint64_t hash = 0;
    uint32_t key_at = 0, key_len = kEmpty, ids_at = 0, ids_len = 0;
  };

  void place(const Slot& slot) {
    const size_t mask = slots_.size() - 1;
    size_t i = slot.hash & mask;
    while (slots_[i].key_len != kEmpty) i = (i + 1) & mask;
    slots_[i] = slot;
    used_++;
  }
  void grow() {
    if (slots_.size() >= kMaxSlots) return clear();
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    used_ = 0;
    for (const Slot& s : old)
      if (s.key_len != kEmpty) place(s);
  }
  void clear() {
    std::fill(slots_.begin(), slots_.end(), Slot{});
    keys_.clear();
    ids_.clear();
    used_ = 0;
  }

  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<uint32_t> ids_;
  size_t used_ = 0;
};

// ---- JSON reading with positions ----------------------------------------------------------------

class JsonFile {
 public:
  explicit JsonFile(const std::string& path) : path_(path) {}

  [[noreturn]] void fail(const std::string& pointer, const std::string& problem) const {
    throw DataError(strprintf("tokenizer file '%s' at %s: %s", path_.c_str(), pointer.empty() ? "/" : pointer.c_str(),
                              problem.c_str()));
  }
  [[noreturn]] void unsupported(const std::string& pointer, const std::string& what) const {
    fail(pointer,
         what + " is not supported; ShardTrain encodes Hugging Face BPE tokenizers, byte-level or SentencePiece-style "
                  "(docs/data.md)");
  }

  const json& member(const json& object, const std::string& pointer, const char* key) const {
    if (!object.is_object()) fail(pointer, "expected a JSON object");
    auto it = object.find(key);
    if (it == object.end()) fail(pointer, strprintf("missing \"%s\"", key));
    return *it;
  }
  // The member, or null where it is absent.
  static const json& optional(const json& object, const char* key) {
    static const json null_value;
    auto it = object.find(key);
    return it == object.end() ? null_value : *it;
  }
  std::string string_at(const json& value, const std::string& pointer) const {
    if (!value.is_string()) fail(pointer, "expected a string");
    return value.get<std::string>();
  }
  bool bool_at(const json& object, const std::string& pointer, const char* key, bool fallback) const {
    const json& v = optional(object, key);
    if (v.is_null()) return fallback;
    if (!v.is_boolean()) fail(pointer + "/" + key, "expected true or false");
    return v.get<bool>();
  }
  // Ids index tables of id + 1 entries and token files: beyond the largest vocabulary a model takes
  // (model.vocab_size <= 2^24) an id is a defect of the file, not a reason to allocate gigabytes.
  uint32_t id_at(const json& value, const std::string& pointer) const {
    if (!value.is_number_unsigned()) fail(pointer, "expected a token id (a whole number >= 0)");
    if (value.get<uint64_t>() >= static_cast<uint64_t>(MAX_VOCAB_SIZE))
      fail(pointer, strprintf("token id %llu is beyond %d, the largest id a model takes (model.vocab_size <= 2^24)",
                              static_cast<unsigned long long>(value.get<uint64_t>()), MAX_VOCAB_SIZE - 1));
    return static_cast<uint32_t>(value.get<uint64_t>());
  }
  std::string type_of(const json& object, const std::string& pointer) const {
    return string_at(member(object, pointer, "type"), pointer + "/type");
  }

 private:
  std::string path_;
};

std::string escape_pointer(const std::string& key) {
  std::string out;
  for (char c : key) out += c == '~' ? "~0" : c == '/' ? "~1" : std::string(1, c);
  return out;
}

// NFC or NFKC on the non-ASCII runs only: an ASCII character is its own normal form, never composes
// with what precedes it nor is reordered (a starter that no composition has second), so text splits
// before each one. The ASCII character before a run goes with it: it may compose with a following mark.
std::string unicode_normal_form(std::string_view text, bool compatibility) {
  const auto ascii = [&](size_t i) { return static_cast<unsigned char>(text[i]) < 0x80; };
  std::string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    size_t run = i;
    while (run < text.size() && ascii(run)) run++;
    if (run == text.size()) {
      out.append(text.substr(i));
      break;
    }
    const size_t begin = run > i ? run - 1 : run;
    size_t end = run;
    while (end < text.size() && !ascii(end)) end++;
    out.append(text.substr(i, begin - i));
    utf8proc_uint8_t* result = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data() + begin),
                                            static_cast<utf8proc_ssize_t>(end - begin), &result,
                                            static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE |
                                                                          (compatibility ? UTF8PROC_COMPAT : 0)));
    if (n < 0) throw DataError(strprintf("%s normalization failed: %s", compatibility ? "NFKC" : "NFC", utf8proc_errmsg(n)));
    out.append(reinterpret_cast<const char*>(result), static_cast<size_t>(n));
    std::free(result);
    i = end;
  }
  return out;
}

// `text` with every `from` replaced by `to`, left to right, in one pass: a Replace
// normalizer may run over a whole document (a file without a pre-tokenizer).
std::string replaced(std::string_view text, const std::string& from, const std::string& to) {
  if (from.empty()) return std::string(text);  // nothing to find (a decoder's empty pattern)
  std::string out;
  size_t done = 0;
  for (size_t at = text.find(from); at != std::string_view::npos; at = text.find(from, done)) {
    out.append(text.substr(done, at - done)).append(to);
    done = at + from.size();
  }
  return out.append(text.substr(done));
}

// The byte of a byte-fallback token "<0xXX>", or -1.
int fallback_byte(const std::string& token) {
  if (token.size() != 6 || token.compare(0, 3, "<0x") != 0 || token[5] != '>') return -1;
  int value = 0;
  for (int i = 3; i < 5; i++) {
    const char c = token[i];
    const int digit = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (digit < 0) return -1;
    value = value * 16 + digit;
  }
  return value;
}

}  // namespace

// ---- the tokenizer ------------------------------------------------------------------------------

struct Tokenizer::Impl {
  std::string path;
  // Normalizer: its steps in order (a Sequence flattened).
  struct NormStep {
    enum Kind { NFC, NFKC, PREPEND, REPLACE } kind;
    std::string text, content;  // PREPEND: text; REPLACE: every `text` becomes `content`
  };
  std::vector<NormStep> norm;
  // Added tokens: cut out of the raw text (normalized=false) or of the normalized text.
  std::vector<AddedToken> added;
  AddedTokenMatcher raw_matcher, normalized_matcher;
  CharClasses classes;
  // Pre-tokenizer: Split stages, then ByteLevel. A SentencePiece-style file (Llama 2, Mistral,
  // TinyLlama) has none or Metaspace instead, and its BPE runs on Unicode characters, not on
  // ByteLevel's byte characters (byte_level false).
  std::vector<std::unique_ptr<Regex>> splits;
  bool prefix_space = false;
  std::unique_ptr<Regex> byte_level_regex;  // null: use_regex false
  bool byte_level = true;
  bool metaspace = false, metaspace_split = true;
  std::string metaspace_char = "\xe2\x96\x81";  // U+2581, the replacement for a space
  enum PrependScheme { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER } prepend_scheme = PREPEND_ALWAYS;
  bool piece_at_text_start = false;  // the piece being pre-tokenized begins the text (Metaspace "first")
  // Model.
  std::unordered_map<std::string, uint32_t> vocab;
  BpeMerges merges;
  bool ignore_merges = false, fuse_unk = false, byte_fallback = false;
  std::optional<uint32_t> unk_id;
  std::vector<std::string> byte_chars;                // raw byte -> its ByteLevel character
  std::vector<std::vector<uint32_t>> byte_symbols;    // raw byte -> initial symbols (empty: unknown)
  // Post-processor: ids around every text.
  std::vector<uint32_t> prefix, suffix;
  bool has_template = false, adding_processor = false;
  uint32_t max_id = 0;
  // Decoding: id -> token string (added tokens win, as in the reference), and ByteLevel's
  // character -> byte table; decoder_problem is why decode() cannot run ("" when it can).
  std::vector<std::optional<std::string>> id_to_token;
  std::unordered_map<std::string, uint8_t> char_to_byte;
  std::string decoder_problem;
  // A SentencePiece-style file's decoder chain (the reference's decoders, in order, on the list of
  // token strings): Replace of a literal, ByteFallback, Fuse, Strip, Metaspace.
  struct DecodeStep {
    enum Kind { REPLACE, BYTE_FALLBACK, FUSE, STRIP, METASPACE } kind;
    std::string text, content;  // REPLACE: text -> content; STRIP: content (one character); METASPACE: text
    int start = 0, stop = 0;    // STRIP: characters cut at most; METASPACE: start 1 strips the first token's space
  };
  std::vector<DecodeStep> decode_steps;
  WordCache cache;
  std::string scratch;
  std::vector<uint32_t> symbols;

  void load(const json& root, const JsonFile& file);
  void load_normalizer(const json& n, const JsonFile& file, const std::string& pointer);
  void load_pre_tokenizer(const json& p, const JsonFile& file);
  void load_model(const json& m, const JsonFile& file);
  void load_post_processor(const json& p, const JsonFile& file, const std::string& pointer);
  void load_decoder(const json& d, const JsonFile& file, const std::string& pointer);
  std::vector<std::string> decode_chain(std::vector<std::string> tokens) const;

  std::string normalize(std::string_view text) const;
  void pre_tokenize(size_t stage, std::string_view piece, std::vector<uint32_t>& out);
  void encode_word(std::string_view raw, std::vector<uint32_t>& out);
  void bpe(std::string_view raw, std::vector<uint32_t>& out);
};

void Tokenizer::Impl::load_normalizer(const json& n, const JsonFile& file, const std::string& pointer) {
  if (n.is_null()) return;
  const std::string type = file.type_of(n, pointer);
  if (type == "NFC" || type == "NFKC") {
    norm.push_back({type == "NFC" ? NormStep::NFC : NormStep::NFKC, "", ""});
  } else if (type == "Prepend") {
    norm.push_back({NormStep::PREPEND, file.string_at(file.member(n, pointer, "prepend"), pointer + "/prepend"), ""});
  } else if (type == "Replace") {
    const json& pattern = file.member(n, pointer, "pattern");
    if (!pattern.is_object() || !pattern.contains("String"))
      file.unsupported(pointer + "/pattern", "a Replace normalizer with a regex pattern");
    const std::string from = file.string_at(pattern["String"], pointer + "/pattern/String");
    if (from.empty()) file.fail(pointer + "/pattern/String", "an empty pattern replaces nothing");
    norm.push_back({NormStep::REPLACE, from, file.string_at(file.member(n, pointer, "content"), pointer + "/content")});
  } else if (type == "Sequence") {
    const json& list = file.member(n, pointer, "normalizers");
    if (!list.is_array()) file.fail(pointer + "/normalizers", "expected a list");
    for (size_t i = 0; i < list.size(); i++)
      load_normalizer(list[i], file, pointer + "/normalizers/" + std::to_string(i));
  } else {
    file.unsupported(pointer + "/type", "normalizer \"" + type + "\"");
  }
}

void Tokenizer::Impl::load_pre_tokenizer(const json& p, const JsonFile& file) {
  const std::string top = "/pre_tokenizer";
  if (p.is_null()) {  // SentencePiece-style: each piece of text is one word
    byte_level = false;
    return;
  }
  if (p.is_object() && p.contains("type") && p["type"] == "Metaspace") {
    byte_level = false, metaspace = true;
    metaspace_char = file.string_at(file.member(p, top, "replacement"), top + "/replacement");
    if (metaspace_char.empty() || next_char(metaspace_char, 0) != metaspace_char.size())
      file.fail(top + "/replacement", "expected one character");
    metaspace_split = file.bool_at(p, top, "split", true);
    const json& scheme = JsonFile::optional(p, "prepend_scheme");
    if (scheme.is_null()) {  // older files: add_prefix_space
      prepend_scheme = file.bool_at(p, top, "add_prefix_space", true) ? PREPEND_ALWAYS : PREPEND_NEVER;
    } else {
      const std::string s = file.string_at(scheme, top + "/prepend_scheme");
      if (s != "always" && s != "first" && s != "never")
        file.fail(top + "/prepend_scheme", "expected always, first or never");
      prepend_scheme = s == "always" ? PREPEND_ALWAYS : s == "first" ? PREPEND_FIRST : PREPEND_NEVER;
    }
    return;
  }
  std::vector<std::pair<const json*, std::string>> stages;
  if (file.type_of(p, top) == "Sequence") {
    const json& list = file.member(p, top, "pretokenizers");
    if (!list.is_array()) file.fail(top + "/pretokenizers", "expected a list");
    for (size_t i = 0; i < list.size(); i++) stages.push_back({&list[i], top + "/pretokenizers/" + std::to_string(i)});
  } else {
    stages.push_back({&p, top});
  }
  for (size_t i = 0; i < stages.size(); i++) {
    const json& s = *stages[i].first;
    const std::string& at = stages[i].second;
    const std::string type = file.type_of(s, at);
    const bool last = i + 1 == stages.size();
    if (type == "ByteLevel" && last) {
      prefix_space = file.bool_at(s, at, "add_prefix_space", true);
      if (file.bool_at(s, at, "use_regex", true))
        byte_level_regex = std::make_unique<Regex>(kGpt2Pattern, false, "GPT-2 pattern");
    } else if (type == "ByteLevel") {
      file.unsupported(at, "ByteLevel before another pre-tokenizer");
    } else if (type == "Split") {
      const std::string behavior = file.string_at(file.member(s, at, "behavior"), at + "/behavior");
      if (behavior != "Isolated") file.unsupported(at + "/behavior", "Split behavior \"" + behavior + "\"");
      if (file.bool_at(s, at, "invert", false)) file.unsupported(at + "/invert", "Split with invert true");
      const json& pattern = file.member(s, at, "pattern");
      if (pattern.is_object() && pattern.contains("Regex"))
        splits.push_back(std::make_unique<Regex>(file.string_at(pattern["Regex"], at + "/pattern/Regex"), false,
                                                 "tokenizer '" + path + "' at " + at + "/pattern/Regex"));
      else if (pattern.is_object() && pattern.contains("String"))
        splits.push_back(std::make_unique<Regex>(file.string_at(pattern["String"], at + "/pattern/String"), true,
                                                 "tokenizer '" + path + "' at " + at + "/pattern/String"));
      else
        file.fail(at + "/pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      if (last) file.unsupported(at, "a pre-tokenizer that does not end in ByteLevel");
    } else {
      file.unsupported(at + "/type", "pre-tokenizer \"" + type + "\"");
    }
  }
}

void Tokenizer::Impl::load_model(const json& m, const JsonFile& file) {
  const std::string at = "/model";
  if (!m.is_object()) file.fail(at, "expected a JSON object");
  // Old files have no "type"; the reference then recognises BPE by its merges.
  const std::string type = m.contains("type") ? file.type_of(m, at) : (m.contains("merges") ? "BPE" : "?");
  if (type != "BPE") file.unsupported(at + "/type", "model \"" + type + "\"");
  const json& dropout = JsonFile::optional(m, "dropout");
  if (!dropout.is_null() && !(dropout.is_number() && dropout.get<double>() == 0))
    file.unsupported(at + "/dropout", "BPE dropout (random merges)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json& v = JsonFile::optional(m, key);
    if (!v.is_null() && !(v.is_string() && v.get<std::string>().empty()))
      file.unsupported(at + "/" + key, std::string("a BPE ") + key);
  }
  ignore_merges = file.bool_at(m, at, "ignore_merges", false);
  fuse_unk = file.bool_at(m, at, "fuse_unk", false);
  byte_fallback = file.bool_at(m, at, "byte_fallback", false);

  const json& v = file.member(m, at, "vocab");
  if (!v.is_object()) file.fail(at + "/vocab", "expected an object {token: id}");
  if (v.empty()) file.fail(at + "/vocab", "the vocabulary is empty: not a tokenizer that can encode anything");
  vocab.reserve(v.size());
  std::unordered_map<uint32_t, std::string> token_of;  // each id names one token
  for (auto it = v.begin(); it != v.end(); ++it) {
    const std::string pointer = at + "/vocab/" + escape_pointer(it.key());
    const uint32_t id = file.id_at(it.value(), pointer);
    if (!token_of.emplace(id, it.key()).second)
      file.fail(pointer, strprintf("id %u is also the id of '%s': two tokens cannot share an id", id,
                                   token_of[id].c_str()));
    vocab.emplace(it.key(), id);
    max_id = std::max(max_id, id);
  }
  const json& unk = JsonFile::optional(m, "unk_token");
  if (!unk.is_null()) {
    auto it = vocab.find(file.string_at(unk, at + "/unk_token"));
    if (it == vocab.end()) file.fail(at + "/unk_token", "the unk_token is not in the vocabulary");
    unk_id = it->second;
  }

  const json& list = file.member(m, at, "merges");
  if (!list.is_array()) file.fail(at + "/merges", "expected a list");
  for (size_t i = 0; i < list.size(); i++) {
    const std::string here = at + "/merges/" + std::to_string(i);
    std::string left, right;
    const json& e = list[i];
    if (e.is_string()) {  // "a b": exactly one space, as the reference splits it
      const std::string s = e.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos)
        file.fail(here, "a merge string must be two tokens separated by one space");
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      left = e[0].get<std::string>();
      right = e[1].get<std::string>();
    } else {
      file.fail(here, "expected \"a b\" or [\"a\", \"b\"]");
    }
    auto a = vocab.find(left), b = vocab.find(right), ab = vocab.find(left + right);
    for (auto* found : {&a, &b, &ab})
      if (*found == vocab.end())
        file.fail(here, "merge token \"" + (found == &a ? left : found == &b ? right : left + right) +
                            "\" is not in the vocabulary");
    merges.add(a->second, b->second, ab->second);
  }

  byte_chars = byte_level_chars();
  byte_symbols.resize(256);
  for (int byte = 0; byte < 256 && byte_level; byte++) {
    auto it = vocab.find(byte_chars[byte]);
    if (it != vocab.end()) {
      byte_symbols[byte] = {it->second};
    } else if (byte_fallback) {  // <0xXX> for each UTF-8 byte of the character, if all exist
      std::vector<uint32_t> ids;
      for (unsigned char c : byte_chars[byte]) {
        auto f = vocab.find(strprintf("<0x%02X>", c));
        if (f == vocab.end()) break;
        ids.push_back(f->second);
      }
      if (ids.size() == byte_chars[byte].size()) byte_symbols[byte] = ids;
    }
  }
}

void Tokenizer::Impl::load_post_processor(const json& p, const JsonFile& file, const std::string& at) {
  if (p.is_null()) return;
  const std::string type = file.type_of(p, at);
  if (type == "ByteLevel") return;  // offsets only
  if (type == "Sequence") {
    const json& list = file.member(p, at, "processors");
    if (!list.is_array()) file.fail(at + "/processors", "expected a list");
    for (size_t i = 0; i < list.size(); i++)
      load_post_processor(list[i], file, at + "/processors/" + std::to_string(i));
    return;
  }
  // The reference applies a second template of a Sequence not at all, and RoBERTa/BERT after a
  // template to a pair: one processor that adds tokens is what is supported.
  if ((type == "RobertaProcessing" || type == "BertProcessing" || type == "TemplateProcessing") && adding_processor)
    file.unsupported(at, "a second post-processor that adds tokens (\"" + type + "\" in a Sequence)");
  adding_processor = true;
  std::vector<uint32_t> before, after;
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {
      const json& pair = file.member(p, at, key);
      if (!pair.is_array() || pair.size() != 2) file.fail(at + "/" + key, "expected [token, id]");
      (key[0] == 'c' ? before : after).push_back(file.id_at(pair[1], at + "/" + key + "/1"));
    }
  } else if (type == "TemplateProcessing") {
    const json& single = file.member(p, at, "single");
    const json& specials = file.member(p, at, "special_tokens");
    if (!single.is_array()) file.fail(at + "/single", "expected a list");
    int sequences = 0;
    for (size_t i = 0; i < single.size(); i++) {
      const std::string here = at + "/single/" + std::to_string(i);
      const json& piece = single[i];
      if (piece.is_object() && piece.contains("Sequence")) {
        const json& id = file.member(piece["Sequence"], here + "/Sequence", "id");
        if (id != "A") file.fail(here + "/Sequence/id", "a single-sequence template can only hold sequence A");
        sequences++;
      } else if (piece.is_object() && piece.contains("SpecialToken")) {
        const std::string name = file.string_at(file.member(piece["SpecialToken"], here + "/SpecialToken", "id"),
                                                here + "/SpecialToken/id");
        const json& entry = file.member(specials, at + "/special_tokens", name.c_str());
        const std::string entry_at = at + "/special_tokens/" + escape_pointer(name);
        const json& ids = file.member(entry, entry_at, "ids");
        if (!ids.is_array()) file.fail(entry_at + "/ids", "expected a list of ids");
        for (size_t k = 0; k < ids.size(); k++)
          (sequences == 0 ? before : after).push_back(file.id_at(ids[k], entry_at + "/ids/" + std::to_string(k)));
      } else {
        file.fail(here, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    if (sequences != 1) file.fail(at + "/single", "the template must hold sequence $A exactly once");
  } else {
    file.unsupported(at + "/type", "post-processor \"" + type + "\"");
  }
  prefix = before;
  suffix = after;
  for (uint32_t id : before) max_id = std::max(max_id, id);
  for (uint32_t id : after) max_id = std::max(max_id, id);
  has_template = !before.empty() || !after.empty();
}

void Tokenizer::Impl::load(const json& root, const JsonFile& file) {
  if (!root.is_object()) file.fail("", "expected a JSON object (a tokenizer.json file)");
  for (const char* key : {"truncation", "padding"})
    if (!JsonFile::optional(root, key).is_null())
      file.unsupported(std::string("/") + key,
                       std::string(key) + " (it would change documents' tokens; set it to null)");
  load_normalizer(JsonFile::optional(root, "normalizer"), file, "/normalizer");
  load_pre_tokenizer(JsonFile::optional(root, "pre_tokenizer"), file);
  load_model(file.member(root, "", "model"), file);
  load_post_processor(JsonFile::optional(root, "post_processor"), file, "/post_processor");

  const json& list = JsonFile::optional(root, "added_tokens");
  if (!list.is_null() && !list.is_array()) file.fail("/added_tokens", "expected a list");
  added.reserve(list.size());  // the matchers point into it
  std::unordered_map<uint32_t, std::string> text_of_id;
  for (const auto& [token, id] : vocab) text_of_id.emplace(id, token);
  for (size_t i = 0; i < list.size(); i++) {
    const std::string at = "/added_tokens/" + std::to_string(i);
    AddedToken t;
    t.id = file.id_at(file.member(list[i], at, "id"), at + "/id");
    t.content = file.string_at(file.member(list[i], at, "content"), at + "/content");
    t.single_word = file.bool_at(list[i], at, "single_word", false);
    t.lstrip = file.bool_at(list[i], at, "lstrip", false);
    t.rstrip = file.bool_at(list[i], at, "rstrip", false);
    t.special = file.bool_at(list[i], at, "special", false);
    t.normalized = file.bool_at(list[i], at, "normalized", !t.special);
    // An added token may repeat the vocabulary's entry for its id (GPT-2's <|endoftext|> does), not
    // give the id to another text.
    const auto [known, fresh] = text_of_id.emplace(t.id, t.content);
    if (!fresh && known->second != t.content)
      file.fail(at + "/id", strprintf("id %u is already '%s', not '%s': an added token cannot take another token's id",
                                      t.id, known->second.c_str(), t.content.c_str()));
    max_id = std::max(max_id, t.id);
    added.push_back(std::move(t));
  }
  for (const AddedToken& t : added) {
    if (t.normalized) normalized_matcher.add(&t, normalize(t.content));
    else raw_matcher.add(&t, t.content);
  }
  raw_matcher.finish();
  normalized_matcher.finish();

  id_to_token.assign(static_cast<size_t>(max_id) + 1, std::nullopt);
  for (const auto& [token, id] : vocab) id_to_token[id] = token;
  for (const AddedToken& t : added) id_to_token[t.id] = t.content;
  for (int b = 0; b < 256; b++) char_to_byte.emplace(byte_chars[b], static_cast<uint8_t>(b));
  const json& decoder = JsonFile::optional(root, "decoder");
  const std::string type = decoder.is_object() && decoder.contains("type") && decoder["type"].is_string()
                               ? decoder["type"].get<std::string>()
                               : std::string(decoder.is_null() ? "none" : "?");
  if (byte_level && type != "ByteLevel")
    decoder_problem = "its decoder (/decoder) is " + type + "; decoding a byte-level tokenizer supports ByteLevel";
  if (!byte_level) load_decoder(decoder, file, "/decoder");
}

void Tokenizer::Impl::load_decoder(const json& d, const JsonFile& file, const std::string& at) {
  const std::string type = d.is_object() && d.contains("type") && d["type"].is_string() ? d["type"].get<std::string>()
                                                                                         : std::string("none");
  if (type == "Sequence") {
    const json& list = file.member(d, at, "decoders");
    if (!list.is_array()) file.fail(at + "/decoders", "expected a list");
    for (size_t i = 0; i < list.size(); i++) load_decoder(list[i], file, at + "/decoders/" + std::to_string(i));
  } else if (type == "Replace") {
    const json& pattern = file.member(d, at, "pattern");
    if (!pattern.is_object() || !pattern.contains("String")) {
      decoder_problem = "its decoder at " + at + " replaces a regex; decoding supports literal replacements";
      return;
    }
    decode_steps.push_back({DecodeStep::REPLACE, file.string_at(pattern["String"], at + "/pattern/String"),
                            file.string_at(file.member(d, at, "content"), at + "/content")});
  } else if (type == "ByteFallback" || type == "Fuse") {
    decode_steps.push_back({type == "Fuse" ? DecodeStep::FUSE : DecodeStep::BYTE_FALLBACK, "", ""});
  } else if (type == "Strip") {
    DecodeStep step{DecodeStep::STRIP, "", file.string_at(file.member(d, at, "content"), at + "/content")};
    step.start = static_cast<int>(file.id_at(file.member(d, at, "start"), at + "/start"));
    step.stop = static_cast<int>(file.id_at(file.member(d, at, "stop"), at + "/stop"));
    decode_steps.push_back(step);
  } else if (type == "Metaspace") {
    DecodeStep step{DecodeStep::METASPACE, file.string_at(file.member(d, at, "replacement"), at + "/replacement"), ""};
    const json& scheme = JsonFile::optional(d, "prepend_scheme");
    step.start = scheme.is_null() ? file.bool_at(d, at, "add_prefix_space", true) : scheme != "never";
    decode_steps.push_back(step);
  } else {
    decoder_problem = "its decoder at " + at + " is " + type +
                      "; decoding a SentencePiece-style tokenizer supports Replace, ByteFallback, Fuse, Strip and "
                      "Metaspace";
  }
}

// The reference's decode_chain of each step, in order, on the token strings.
std::vector<std::string> Tokenizer::Impl::decode_chain(std::vector<std::string> tokens) const {
  for (const DecodeStep& step : decode_steps) {
    std::vector<std::string> next;
    switch (step.kind) {
      case DecodeStep::REPLACE:
        for (std::string& t : tokens) t = replaced(t, step.text, step.content);
        continue;
      case DecodeStep::METASPACE:  // the replacement is a space, except in the first token (prepended there)
        for (size_t i = 0; i < tokens.size(); i++) tokens[i] = replaced(tokens[i], step.text, i == 0 && step.start ? "" : " ");
        continue;
      case DecodeStep::FUSE: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, all);
        continue;
      }
      case DecodeStep::STRIP:
        for (std::string& t : tokens) {  // up to start leading and stop trailing characters equal to content
          size_t begin = 0, end = t.size();
          for (int i = 0; i < step.start && begin < end && t.compare(begin, step.content.size(), step.content) == 0; i++)
            begin += step.content.size();
          for (int i = 0; i < step.stop && end - begin >= step.content.size() &&
                          t.compare(end - step.content.size(), step.content.size(), step.content) == 0;
               i++)
            end -= step.content.size();
          t = t.substr(begin, end - begin);
        }
        continue;
      case DecodeStep::BYTE_FALLBACK: {
        // Runs of <0xXX> tokens become their bytes when those are UTF-8, else one U+FFFD each.
        std::string bytes;
        const auto flush = [&] {
          if (bytes.empty()) return;
          if (utf8_with_replacements(bytes) == bytes) next.push_back(bytes);
          else for (size_t i = 0; i < bytes.size(); i++) next.push_back("\xef\xbf\xbd");
          bytes.clear();
        };
        for (const std::string& t : tokens) {
          if (const int byte = fallback_byte(t); byte >= 0) {
            bytes += static_cast<char>(byte);
          } else {
            flush();
            next.push_back(t);
          }
        }
        flush();
        tokens = std::move(next);
        continue;
      }
    }
  }
  return tokens;
}

// The normalizer's steps in order, as the reference applies them to a piece of text.
std::string Tokenizer::Impl::normalize(std::string_view text) const {
  std::string out(text);
  for (const NormStep& step : norm) {
    if (step.kind == NormStep::NFC || step.kind == NormStep::NFKC) {
      out = unicode_normal_form(out, step.kind == NormStep::NFKC);
    } else if (step.kind == NormStep::PREPEND) {
      if (!out.empty()) out.insert(0, step.text);  // the reference prepends to non-empty text only
    } else {
      out = replaced(out, step.text, step.content);
    }
  }
  return out;
}

void Tokenizer::Impl::pre_tokenize(size_t stage, std::string_view piece, std::vector<uint32_t>& out) {
  if (piece.empty()) return;
  if (!byte_level) {
    if (!metaspace) return encode_word(piece, out);  // no pre-tokenizer: the piece is one word
    // Metaspace: spaces become the replacement character, which begins the text (or the piece),
    // and with split each word starts at one (the reference's MergedWithNext).
    std::string text;
    text.reserve(piece.size() + metaspace_char.size());
    const bool prepend = prepend_scheme == PREPEND_ALWAYS || (prepend_scheme == PREPEND_FIRST && piece_at_text_start);
    if (prepend && piece.substr(0, metaspace_char.size()) != metaspace_char && piece[0] != ' ') text = metaspace_char;
    for (char c : piece) {
      if (c == ' ') text.append(metaspace_char);
      else text.push_back(c);
    }
    if (!metaspace_split) return encode_word(text, out);
    size_t begin = 0;
    for (size_t at = text.find(metaspace_char, 1); at != std::string::npos; at = text.find(metaspace_char, at + 1)) {
      encode_word(std::string_view(text).substr(begin, at - begin), out);
      begin = at;
    }
    return encode_word(std::string_view(text).substr(begin), out);
  }
  if (stage < splits.size()) {
    splits[stage]->split_isolated(piece, [&](std::string_view p) { pre_tokenize(stage + 1, p, out); });
    return;
  }
  std::string with_space;
  if (prefix_space && piece[0] != ' ') {
    with_space.reserve(piece.size() + 1);
    with_space.append(1, ' ').append(piece);
    piece = with_space;
  }
  if (byte_level_regex) byte_level_regex->split_isolated(piece, [&](std::string_view w) { encode_word(w, out); });
  else encode_word(piece, out);
}

void Tokenizer::Impl::encode_word(std::string_view raw, std::vector<uint32_t>& out) {
  const uint64_t hash = std::hash<std::string_view>()(raw);
  uint32_t count = 0;
  if (const uint32_t* ids = cache.find(raw, hash, count)) {
    out.insert(out.end(), ids, ids + count);
    return;
  }
  const size_t start = out.size();
  bpe(raw, out);
  // A long word is a whole piece of text (no pre-tokenizer, or Metaspace without split), which
  // never comes again: caching it would only hold its memory.
  if (raw.size() <= 256) cache.insert(raw, hash, out.data() + start, out.size() - start);
}

void Tokenizer::Impl::bpe(std::string_view raw, std::vector<uint32_t>& out) {
  if (ignore_merges) {  // a word that is a token as a whole stays one
    scratch.clear();
    if (byte_level)
      for (unsigned char c : raw) scratch += byte_chars[c];
    else
      scratch = raw;
    auto it = vocab.find(scratch);
    if (it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  symbols.clear();
  bool unk_before = false;
  const auto unknown = [&] {  // unknown without unk_token: dropped, as the reference does
    if (unk_id && !(fuse_unk && unk_before)) symbols.push_back(*unk_id);
    unk_before = unk_id.has_value();
  };
  if (byte_level) {
    for (unsigned char c : raw) {
      const std::vector<uint32_t>& s = byte_symbols[c];
      if (s.empty()) {
        unknown();
        continue;
      }
      symbols.insert(symbols.end(), s.begin(), s.end());
      unk_before = false;
    }
  } else {  // the word's Unicode characters; one missing from the vocabulary as its bytes' <0xXX> tokens
    for (size_t i = 0, next; i < raw.size(); i = next) {
      next = next_char(raw, i);
      scratch.assign(raw.substr(i, next - i));
      if (auto it = vocab.find(scratch); it != vocab.end()) {
        symbols.push_back(it->second);
        unk_before = false;
        continue;
      }
      size_t found = 0;
      for (size_t b = i; byte_fallback && b < next; b++, found++) {
        auto it = vocab.find(strprintf("<0x%02X>", static_cast<unsigned char>(raw[b])));
        if (it == vocab.end()) break;
        symbols.push_back(it->second);
      }
      if (byte_fallback && found == next - i) {
        unk_before = false;
        continue;
      }
      symbols.resize(symbols.size() - found);
      unknown();
    }
  }
  merges.apply(symbols);
  out.insert(out.end(), symbols.begin(), symbols.end());
}

Tokenizer::Tokenizer(const std::string& path) : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))  // opens, then fails its first read with EISDIR
    throw DataError(strprintf("tokenizer file '%s' is a folder; give the tokenizer.json file in it", path.c_str()));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(strprintf("tokenizer file '%s': cannot open; check the --tokenizer path", path.c_str()));
  std::string text;
  try {
    text.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  } catch (const std::exception& e) {
    throw DataError(strprintf("tokenizer file '%s': cannot read: %s", path.c_str(), e.what()));
  }
  json root;
  try {
    root = json::parse(text);
  } catch (const json::parse_error& e) {
    throw DataError(strprintf("tokenizer file '%s': malformed JSON (byte %zu): %s", path.c_str(), e.byte,
                              json_error_text(e.what()).c_str()));
  } catch (const json::exception& e) {  // a number beyond double's range (1e999): out_of_range
    throw DataError(strprintf("tokenizer file '%s': malformed JSON: %s", path.c_str(),
                              json_error_text(e.what()).c_str()));
  }
  impl_->load(root, JsonFile(path));
}

Tokenizer::~Tokenizer() = default;

void Tokenizer::encode(std::string_view text, std::vector<uint32_t>& out, bool add_special_tokens) {
  Impl& m = *impl_;
  if (add_special_tokens) out.insert(out.end(), m.prefix.begin(), m.prefix.end());
  std::vector<Piece> raw_pieces, normalized_pieces;
  if (m.raw_matcher.empty()) raw_pieces.push_back({0, text.size(), -1});
  else m.raw_matcher.split(text, m.classes, raw_pieces);
  for (const Piece& p : raw_pieces) {
    if (p.id >= 0) {
      out.push_back(static_cast<uint32_t>(p.id));
      continue;
    }
    const std::string normalized = m.normalize(text.substr(p.begin, p.end - p.begin));
    const std::string_view n = normalized;
    if (m.normalized_matcher.empty()) normalized_pieces.assign(1, {0, n.size(), -1});
    else m.normalized_matcher.split(n, m.classes, normalized_pieces);
    for (const Piece& q : normalized_pieces) {
      if (q.id >= 0) {
        out.push_back(static_cast<uint32_t>(q.id));
        continue;
      }
      m.piece_at_text_start = p.begin == 0 && q.begin == 0;
      m.pre_tokenize(0, n.substr(q.begin, q.end - q.begin), out);
    }
  }
  if (add_special_tokens) out.insert(out.end(), m.suffix.begin(), m.suffix.end());
}

uint32_t Tokenizer::vocab_size() const { return impl_->max_id + 1; }

bool Tokenizer::adds_special_tokens() const { return impl_->has_template; }

std::optional<uint32_t> Tokenizer::token_id(const std::string& content) const {
  for (const AddedToken& t : impl_->added)
    if (t.content == content) return t.id;
  auto it = impl_->vocab.find(content);
  if (it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

bool Tokenizer::is_special(const std::string& content) const {
  for (const AddedToken& t : impl_->added)
    if (t.content == content) return t.special;
  return false;
}

std::string Tokenizer::token_bytes(uint32_t id) const {
  const Impl& m = *impl_;
  if (!m.decoder_problem.empty())
    throw DataError(strprintf("tokenizer file '%s': %s", m.path.c_str(), m.decoder_problem.c_str()));
  if (id >= m.id_to_token.size() || !m.id_to_token[id])
    throw DataError(strprintf("token id %u is not in tokenizer file '%s' (ids up to %u); decode with the tokenizer "
                              "the file was encoded with",
                              id, m.path.c_str(), m.max_id));
  const std::string& token = *m.id_to_token[id];
  if (!m.byte_level) {  // the decoder's replacements and byte fallback, not its strips (a piece of a text)
    if (const int byte = fallback_byte(token); byte >= 0) return std::string(1, static_cast<char>(byte));
    std::string text = token;
    for (const Impl::DecodeStep& step : m.decode_steps)
      if (step.kind == Impl::DecodeStep::REPLACE || step.kind == Impl::DecodeStep::METASPACE)
        text = replaced(text, step.text, step.kind == Impl::DecodeStep::REPLACE ? step.content : " ");
    return text;
  }
  std::string mapped;
  for (size_t i = 0, next; i < token.size(); i = next) {
    next = next_char(token, i);
    auto it = m.char_to_byte.find(token.substr(i, next - i));
    if (it == m.char_to_byte.end()) return token;
    mapped += static_cast<char>(it->second);
  }
  return mapped;
}

std::string Tokenizer::decode(const std::vector<uint32_t>& ids) const {
  const Impl& m = *impl_;
  std::string bytes;
  if (m.byte_level) {
    for (uint32_t id : ids) bytes += token_bytes(id);
    return utf8_with_replacements(bytes);
  }
  if (!m.decoder_problem.empty())
    throw DataError(strprintf("tokenizer file '%s': %s", m.path.c_str(), m.decoder_problem.c_str()));
  std::vector<std::string> tokens;
  for (uint32_t id : ids) {
    if (id >= m.id_to_token.size() || !m.id_to_token[id]) token_bytes(id);  // throws, naming the id
    tokens.push_back(*m.id_to_token[id]);
  }
  for (const std::string& piece : m.decode_chain(std::move(tokens))) bytes += piece;
  return utf8_with_replacements(bytes);
}

const std::vector<uint32_t>& Tokenizer::appended_ids() const { return impl_->suffix; }

const std::vector<uint32_t>& Tokenizer::prepended_ids() const { return impl_->prefix; }

}  // namespace shardtrain
