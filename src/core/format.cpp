// See format.hpp.
#include "core/format.hpp"

#include <algorithm>
#include <cstdint>

#include "core/error.hpp"

namespace shardtrain {

std::string human_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (bytes >= 1024 && u < 6) bytes /= 1024, u++;
  return strprintf(u == 0 ? "%.0f %s" : "%.1f %s", bytes, units[u]);
}

// Characters a terminal shows as nothing, or that would break a one-line message.
bool invisible(uint32_t cp) {
  return cp < 0x20 || (cp >= 0x7f && cp <= 0xa0) || cp == 0xad || (cp >= 0x200b && cp <= 0x200f) ||
         (cp >= 0x2028 && cp <= 0x202e) || (cp >= 0x2060 && cp <= 0x2064) || cp == 0xfeff;
}

// The UTF-8 character at s[i]: its length, or 0 for an invalid sequence.
size_t utf8_char(const std::string& s, size_t i, uint32_t* cp) {
  const unsigned char lead = s[i];
  const size_t n = lead < 0x80 ? 1 : (lead >> 5) == 6 ? 2 : (lead >> 4) == 14 ? 3 : (lead >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + n > s.size()) return 0;
  *cp = n == 1 ? lead : lead & (0x7f >> n);
  for (size_t k = 1; k < n; k++) {
    const unsigned char next = s[i + k];
    if ((next >> 6) != 2) return 0;
    *cp = (*cp << 6) | (next & 0x3f);
  }
  return n;
}

std::string printable_text(const std::string& text, size_t max_chars) {
  std::string out;
  size_t i = 0;
  for (size_t chars = 0; i < text.size() && chars < max_chars; chars++) {
    uint32_t cp = 0;
    const size_t n = utf8_char(text, i, &cp);
    if (n == 0)
      out += strprintf("<0x%02X>", static_cast<unsigned char>(text[i]));
    else
      out += invisible(cp) ? strprintf("<U+%04X>", cp) : text.substr(i, n);
    i += std::max<size_t>(n, 1);
  }
  if (i < text.size()) out += strprintf("... (%zu bytes in all)", text.size());
  return out;
}

}  // namespace shardtrain
