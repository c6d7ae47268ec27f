// The synthetic corpus grammar. Each sentence kind is one function that appends text and draws its
// choices from a counter RNG (key = mix64(seed), counter = number of draws so far), while tallying
// -log p of each choice so the corpus can state its own entropy. Word lists are constant tables.
#include "data/synth.hpp"

#include <cmath>
#include <utility>

#include "core/random.hpp"

namespace shardtrain {

namespace {

struct Noun {
  const char* one;
  const char* many;
};
struct Verb {
  const char* one;  // third person singular
  const char* many;
};

constexpr Noun NOUNS[] = {
    {"cat", "cats"},     {"dog", "dogs"},       {"bird", "birds"},   {"fox", "foxes"},    {"mouse", "mice"},
    {"child", "children"}, {"box", "boxes"},    {"tree", "trees"},   {"boat", "boats"},   {"apple", "apples"},
    {"stone", "stones"}, {"horse", "horses"},   {"fish", "fish"},    {"book", "books"},   {"lamp", "lamps"},
    {"frog", "frogs"},   {"sheep", "sheep"},    {"wolf", "wolves"},  {"key", "keys"},     {"cup", "cups"},
    {"bell", "bells"},   {"coat", "coats"},     {"duck", "ducks"},   {"goat", "goats"},   {"hat", "hats"},
    {"king", "kings"},   {"queen", "queens"},   {"ship", "ships"},   {"star", "stars"},   {"train", "trains"},
    {"bear", "bears"},   {"leaf", "leaves"}};
constexpr Verb VERBS[] = {{"sees", "see"},     {"chases", "chase"},   {"likes", "like"},     {"finds", "find"},
                          {"eats", "eat"},     {"carries", "carry"},  {"watches", "watch"},  {"follows", "follow"},
                          {"pushes", "push"},  {"hides", "hide"},     {"holds", "hold"},     {"helps", "help"},
                          {"paints", "paint"}, {"counts", "count"},   {"wants", "want"},     {"meets", "meet"}};
constexpr const char* ADJECTIVES[] = {"red",    "blue",  "green",  "small", "big",   "old",    "young",  "happy",
                                      "quiet",  "fast",  "slow",   "bright", "dark", "little", "yellow", "brown",
                                      "white",  "black", "tall",   "short", "warm",  "cold",   "soft",   "loud",
                                      "clever", "lazy",  "brave",  "shy",   "round", "heavy",  "gentle", "busy"};
constexpr const char* ADVERBS[] = {"often", "never", "always", "sometimes", "quickly", "slowly", "quietly", "rarely"};
constexpr const char* NAMES[] = {"Anna", "Ben",   "Clara", "David", "Emma",  "Felix", "Grace", "Henry",
                                 "Iris", "Jack",  "Kate",  "Leo",   "Mia",   "Noah",  "Olga",  "Paul",
                                 "Rosa", "Sam",   "Tom",   "Uma",   "Vera",  "Will",  "Xena",  "Yuri",
                                 "Zoe",  "Adam",  "Bella", "Carl",  "Dora",  "Eric",  "Fiona", "Gus"};
constexpr const char* PLACES[] = {"garden", "kitchen", "forest", "river", "house",  "school", "park",  "market",
                                  "barn",   "field",   "castle", "lake",  "cave",   "city",   "shop",  "hill"};
constexpr const char* NUMBER_WORDS[] = {"zero",    "one",      "two",      "three",   "four",     "five",     "six",
                                        "seven",   "eight",    "nine",     "ten",     "eleven",   "twelve",   "thirteen",
                                        "fourteen", "fifteen", "sixteen",  "seventeen", "eighteen", "nineteen", "twenty"};

template <typename T, size_t N>
constexpr size_t count_of(const T (&)[N]) {
  return N;
}

class SynthWriter {
 public:
  explicit SynthWriter(uint64_t seed) : key_(mix64(seed)) {}

  // Uniform choice in [0, n); its information is log n.
  size_t pick(size_t n) {
    const double u = counter_uniform(key_, counter_++);
    size_t i = static_cast<size_t>(u * static_cast<double>(n));
    if (i >= n) i = n - 1;
    nats_ += std::log(static_cast<double>(n));
    return i;
  }
  // True with probability p.
  bool chance(double p) {
    const bool yes = counter_uniform(key_, counter_++) < p;
    nats_ -= std::log(yes ? p : 1.0 - p);
    return yes;
  }
  template <typename T, size_t N>
  const T& pick_from(const T (&table)[N]) {
    return table[pick(N)];
  }

  void put(const char* text) { sentence_ += text; }
  void put(const std::string& text) { sentence_ += text; }
  void number(long value) { sentence_ += std::to_string(value); }

  // Ends a sentence: capitalised, then a space or (one time in six) a paragraph break.
  void end_sentence() {
    if (sentence_[0] >= 'a' && sentence_[0] <= 'z') sentence_[0] = static_cast<char>(sentence_[0] - 'a' + 'A');
    text_ += sentence_;
    text_ += chance(1.0 / 6.0) ? "\n" : " ";
    sentence_.clear();
  }

  const std::string& text() const { return text_; }
  double nats() const { return nats_; }

 private:
  uint64_t key_;
  uint64_t counter_ = 0;
  double nats_ = 0;
  std::string text_, sentence_;
};

// "the small red fox often chases the mice in the barn." — subject number decides the verb form.
void noun_phrase(SynthWriter& w, bool many) {
  w.put("the ");
  for (int i = 0; i < 2 && w.chance(0.5); i++) w.put(std::string(w.pick_from(ADJECTIVES)) + " ");
  const Noun& noun = w.pick_from(NOUNS);
  w.put(many ? noun.many : noun.one);
}

void describe(SynthWriter& w) {
  const bool many = w.chance(0.3);
  noun_phrase(w, many);
  if (w.chance(0.3)) w.put(std::string(" ") + w.pick_from(ADVERBS));
  const Verb& verb = w.pick_from(VERBS);
  w.put(std::string(" ") + (many ? verb.many : verb.one) + " ");
  noun_phrase(w, w.chance(0.5));
  if (w.chance(0.3)) w.put(std::string(" in the ") + w.pick_from(PLACES));
  w.put(".");
}

// "seven plus two is nine." / "37 plus 45 is 82." — the answer is determined by the question.
// In digits the operands go up to 99 (12 for times), which carries most of the corpus's entropy.
void arithmetic(SynthWriter& w) {
  const bool digits = w.chance(0.5);
  const int op = static_cast<int>(w.pick(3));  // plus, minus, times
  const size_t range = op == 2 ? (digits ? 13 : 5) : (digits ? 100 : 11);
  int a = static_cast<int>(w.pick(range)), b = static_cast<int>(w.pick(range));
  if (op == 1 && b > a) std::swap(a, b);  // no negative results
  const int result = op == 0 ? a + b : op == 1 ? a - b : a * b;
  auto say = [&](int n) {
    if (digits) w.number(n);
    else w.put(NUMBER_WORDS[n]);
  };
  say(a);
  w.put(op == 0 ? " plus " : op == 1 ? " minus " : " times ");
  say(b);
  w.put(" is ");
  say(result);
  w.put(".");
}

// "count from three to six: three, four, five, six."
void counting(SynthWriter& w) {
  const int from = static_cast<int>(w.pick(15));
  const int to = from + 1 + static_cast<int>(w.pick(5));
  w.put(std::string("count from ") + NUMBER_WORDS[from] + " to " + NUMBER_WORDS[to] + ":");
  for (int n = from; n <= to; n++) w.put(std::string(n == from ? " " : ", ") + NUMBER_WORDS[n]);
  w.put(".");
}

// A three-sentence story whose last sentence is determined by the first two (copy + subtract).
void story(SynthWriter& w) {
  const size_t giver_index = w.pick(count_of(NAMES));
  const char* giver = NAMES[giver_index];
  const char* taker = NAMES[(giver_index + 1 + w.pick(count_of(NAMES) - 1)) % count_of(NAMES)];  // someone else
  const Noun& thing = w.pick_from(NOUNS);
  const int have = 2 + static_cast<int>(w.pick(9));
  const int give = 1 + static_cast<int>(w.pick(static_cast<size_t>(have) - 1));
  w.put(std::string(giver) + " has " + NUMBER_WORDS[have] + " " + thing.many + ".");
  w.end_sentence();
  w.put(std::string(giver) + " gives " + NUMBER_WORDS[give] + " to " + taker + ".");
  w.end_sentence();
  w.put(std::string("now ") + giver + " has " + NUMBER_WORDS[have - give] + " " + thing.many + ".");
}

// "the old key is in the barn. where is the old key? in the barn." — question answered by copying.
void where_is(SynthWriter& w) {
  const char* adjective = w.pick_from(ADJECTIVES);
  const Noun& thing = w.pick_from(NOUNS);
  const char* place = w.pick_from(PLACES);
  const std::string phrase = std::string("the ") + adjective + " " + thing.one;
  w.put(phrase + " is in the " + place + ".");
  w.end_sentence();
  w.put("where is " + phrase + "? in the " + place + ".");
}

// "Mia likes green frogs. what does Mia like? green frogs."
void likes(SynthWriter& w) {
  const char* name = w.pick_from(NAMES);
  const std::string what = std::string(w.pick_from(ADJECTIVES)) + " " + w.pick_from(NOUNS).many;
  w.put(std::string(name) + " likes " + what + ".");
  w.end_sentence();
  w.put(std::string("what does ") + name + " like? " + what + ".");
}

// "Leo's code is qxvb. what is Leo's code? qxvb." — random letters, recalled by copying.
void secret_code(SynthWriter& w) {
  const char* name = w.pick_from(NAMES);
  std::string code;
  const size_t length = 3 + w.pick(4);
  for (size_t i = 0; i < length; i++) code += static_cast<char>('a' + w.pick(26));
  w.put(std::string(name) + "'s code is " + code + ".");
  if (w.chance(0.5)) {
    w.end_sentence();
    w.put(std::string("what is ") + name + "'s code? " + code + ".");
  }
}

// Generates sentences until at least num_bytes; returns the writer for text and entropy.
SynthWriter generate(uint64_t seed, size_t num_bytes) {
  SynthWriter w(seed);
  // Sentence kinds by weight (out of 20): description 7, arithmetic 5, code 3, story 2, where 1,
  // likes 1, counting 1. The copy-heavy kinds are rarer so most bytes carry some information.
  while (w.text().size() < num_bytes) {
    const size_t kind = w.pick(20);
    if (kind < 7) describe(w);
    else if (kind < 12) arithmetic(w);
    else if (kind < 15) secret_code(w);
    else if (kind < 17) story(w);
    else if (kind < 18) where_is(w);
    else if (kind < 19) likes(w);
    else counting(w);
    w.end_sentence();
  }
  return w;
}

}  // namespace

std::string synth_corpus(uint64_t seed, size_t num_bytes) {
  std::string text = generate(seed, num_bytes).text();
  text.resize(num_bytes);
  return text;
}

double synth_corpus_entropy(uint64_t seed, size_t num_bytes) {
  if (num_bytes == 0) return 0.0;
  const SynthWriter w = generate(seed, num_bytes);
  // The last sentence may run past num_bytes; scale by the bytes actually generated.
  return w.nats() / static_cast<double>(w.text().size());
}

}  // namespace shardtrain
