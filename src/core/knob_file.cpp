// Knob files (epmoe/config.hpp, docs/tuning.md#knob-files): written by knob_file_text, read by
// with_knob_text / with_knob_file. One `key` line says what the knobs were chosen for; one line per
// bucket holds its knobs as name=value fields, the names and spellings of describe().
#include <climits>
#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "core/knob_table.hpp"
#include "epmoe/config.hpp"
#include "epmoe/errors.hpp"

namespace epmoe {
namespace {

constexpr const char* kHeader = "# epmoe knob file v1 (docs/tuning.md#knob-files)";

// The fields a file's key must match, in the order written.
std::vector<std::pair<std::string, std::string>> key_of(const LayerConfig& c) {
  return {{"precision", to_string(c.precision())},
          {"world", std::to_string(c.world())},
          {"hidden", std::to_string(c.shape().hidden)},
          {"intermediate", std::to_string(c.shape().intermediate)},
          {"num_experts", std::to_string(c.shape().num_experts)},
          {"top_k", std::to_string(c.shape().top_k)},
          {"expert_math", to_string(c.options().expert_math)}};
}

// Throws naming where: "<source>:<line>: <what>".
[[noreturn]] void fail(const std::string& source, int line, const std::string& what) {
  throw Error(ErrorCode::invalid_argument, source + ":" + std::to_string(line) + ": " + what);
}

// The name=value fields after a line's first word.
std::vector<std::pair<std::string, std::string>> fields_of(std::istringstream& words,
                                                           const std::string& source, int line) {
  std::vector<std::pair<std::string, std::string>> fields;
  std::string word;
  while (words >> word) {
    const std::size_t eq = word.find('=');
    if (eq == std::string::npos || eq == 0 || eq + 1 == word.size())
      fail(source, line, "'" + word + "' is not name=value");
    fields.emplace_back(word.substr(0, eq), word.substr(eq + 1));
  }
  return fields;
}

std::int32_t int_field(const std::string& name, const std::string& value, const std::string& source,
                       int line) {
  std::size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(value, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != value.size() || v < INT32_MIN || v > INT32_MAX)
    fail(source, line, name + "=" + value + ": not an integer");
  return static_cast<std::int32_t>(v);
}

// `base` with the fields given (a line may name only some knobs).
Knobs knobs_of(const Knobs& base, const std::vector<std::pair<std::string, std::string>>& fields,
               const std::string& source, int line) {
  Knobs k = base;
  for (const auto& [name, value] : fields) {
    if (name == "token_back") {
      try {
        k.token_back = parse_token_back(value);
      } catch (const Error& e) {
        fail(source, line, e.what());
      }
    } else if (name == "block_m") {
      k.block_m = int_field(name, value, source, line);
    } else if (name == "block_n") {
      k.block_n = int_field(name, value, source, line);
    } else if (name == "stages") {
      // Written by older versions; no code ever read it (pipeline depth is not a knob), so
      // ignoring it changes nothing that runs.
    } else if (name == "dispatch_warps") {
      k.dispatch_warps = int_field(name, value, source, line);
    } else if (name == "num_sms") {
      k.num_sms = int_field(name, value, source, line);
    } else if (name == "megakernel") {
      if (value != "true" && value != "false")
        fail(source, line, "megakernel=" + value + ": must be true or false");
      k.megakernel = value == "true";
    } else {
      fail(source, line,
           "unknown knob '" + name +
               "' (token_back, block_m, block_n, dispatch_warps, num_sms, megakernel)");
    }
  }
  return k;
}

}  // namespace

std::string knob_file_text(const LayerConfig& config) {
  std::string s = kHeader;
  s += "\nkey";
  for (const auto& [name, value] : key_of(config)) s += " " + name + "=" + value;
  s += "\n";
  for (int b = 0; b < kNumTokenBuckets; ++b) {
    const auto bucket = static_cast<TokenBucket>(b);
    s += to_string(bucket);
    s += " " + core::knob_fields(config.knobs(bucket)) + "\n";
  }
  return s;
}

LayerConfig with_knob_text(const LayerConfig& config, const std::string& text,
                           const std::string& source) {
  LayerConfig result = config;
  std::istringstream lines(text);
  std::string raw;
  bool keyed = false;
  for (int line = 1; std::getline(lines, raw); ++line) {
    std::istringstream words(raw);
    std::string first;
    if (!(words >> first) || first[0] == '#') continue;
    const auto fields = fields_of(words, source, line);
    if (first == "key") {
      const auto want = key_of(config);
      for (const auto& [name, value] : fields) {
        bool known = false;
        for (const auto& [want_name, want_value] : want) {
          if (name != want_name) continue;
          known = true;
          if (value != want_value)
            fail(source, line,
                 "tuned for " + name + "=" + value + ", this layer has " + name + "=" + want_value);
        }
        if (!known) fail(source, line, "unknown key field '" + name + "'");
      }
      if (fields.size() != want.size())
        fail(source, line,
             "the key names " + std::to_string(fields.size()) + " fields, a key has " +
                 std::to_string(want.size()) +
                 " (precision world hidden intermediate num_experts "
                 "top_k expert_math)");
      keyed = true;
      continue;
    }
    if (!keyed) fail(source, line, "a bucket line before the key line");
    int bucket = -1;
    for (int b = 0; b < kNumTokenBuckets; ++b)
      if (first == to_string(static_cast<TokenBucket>(b))) bucket = b;
    if (bucket < 0)
      fail(source, line, "unknown bucket '" + first + "' (decode, small, medium, prefill)");
    const auto b = static_cast<TokenBucket>(bucket);
    const Knobs knobs = knobs_of(result.knobs(b), fields, source, line);
    try {
      result = with_knobs(result, knobs, b);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::invalid_argument) throw;
      fail(source, line, e.what());
    }
  }
  if (!keyed) fail(source, 0, "no key line (a knob file starts with 'key precision=... ')");
  return result;
}

LayerConfig with_knob_file(const LayerConfig& config, const std::string& path) {
  std::ifstream file(path);
  if (!file) throw Error(ErrorCode::invalid_argument, "knob file '" + path + "': cannot be read");
  std::ostringstream text;
  text << file.rdbuf();
  return with_knob_text(config, text.str(), path);
}

}  // namespace epmoe
