#include "common/json.h"

#include <cerrno>
#include <charconv>
#include <cstdlib>

#include "common/errors.h"
#include "common/strings.h"

namespace dt::json {
namespace {

constexpr int kMaxDepth = 64;

class Parser {
 public:
  Parser(std::string_view text, const std::string& what) : s_(text), what_(what) {}

  Value document() {
    Value v = value(0);
    ws();
    if (i_ != s_.size()) fail("text after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& problem) const {
    throw InvalidArgument(str(what_, " is corrupt at byte ", i_, ": ", problem));
  }
  void ws() {
    while (i_ < s_.size() && (s_[i_] == ' ' || s_[i_] == '\n' || s_[i_] == '\t' || s_[i_] == '\r')) ++i_;
  }
  char peek() {
    ws();
    if (i_ >= s_.size()) fail("unexpected end of the text");
    return s_[i_];
  }
  void expect(char c) {
    if (peek() != c) fail(str("expected '", c, "'"));
    ++i_;
  }
  unsigned hex4() {
    if (i_ + 4 > s_.size()) fail("short \\u escape");
    unsigned code = 0;
    for (int k = 0; k < 4; ++k) {
      const char c = s_[i_++];
      code <<= 4;
      if (c >= '0' && c <= '9') code |= static_cast<unsigned>(c - '0');
      else if (c >= 'a' && c <= 'f') code |= static_cast<unsigned>(c - 'a' + 10);
      else if (c >= 'A' && c <= 'F') code |= static_cast<unsigned>(c - 'A' + 10);
      else fail("bad hex digit in a \\u escape");
    }
    return code;
  }
  static void appendUtf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xc0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xe0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (code & 0x3f));
    }
  }
  std::string string() {
    expect('"');
    std::string out;
    for (;;) {
      if (i_ >= s_.size()) fail("unterminated string");
      const char c = s_[i_++];
      if (c == '"') return out;
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c != '\\') {
        out += c;
        continue;
      }
      if (i_ >= s_.size()) fail("unterminated escape");
      const char e = s_[i_++];
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned code = hex4();
          if (code >= 0xd800 && code < 0xdc00 && i_ + 6 <= s_.size() && s_[i_] == '\\' && s_[i_ + 1] == 'u') {
            i_ += 2;
            const unsigned low = hex4();
            if (low < 0xdc00 || low >= 0xe000) fail("unpaired surrogate in a \\u escape");
            code = 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00);
          }
          appendUtf8(out, code);
          break;
        }
        default: fail(str("bad escape \\", e));
      }
    }
  }
  Value number() {
    const size_t start = i_;
    if (s_[i_] == '-') ++i_;
    auto digits = [&] {
      const size_t from = i_;
      while (i_ < s_.size() && s_[i_] >= '0' && s_[i_] <= '9') ++i_;
      if (i_ == from) fail("expected a digit");
    };
    digits();
    if (i_ < s_.size() && s_[i_] == '.') {
      ++i_;
      digits();
    }
    if (i_ < s_.size() && (s_[i_] == 'e' || s_[i_] == 'E')) {
      ++i_;
      if (i_ < s_.size() && (s_[i_] == '+' || s_[i_] == '-')) ++i_;
      digits();
    }
    return Value::numberText(std::string(s_.substr(start, i_ - start)));
  }
  void word(std::string_view w) {
    if (s_.substr(i_, w.size()) != w) fail("expected a value");
    i_ += w.size();
  }
  Value value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than 64");
    const char c = peek();
    if (c == '{') {
      ++i_;
      Value v = Value::object();
      if (peek() == '}') {
        ++i_;
        return v;
      }
      for (;;) {
        if (peek() != '"') fail("expected a member name");
        std::string key = string();
        expect(':');
        v.set(std::move(key), value(depth + 1));
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect('}');
        return v;
      }
    }
    if (c == '[') {
      ++i_;
      Value v = Value::array();
      if (peek() == ']') {
        ++i_;
        return v;
      }
      for (;;) {
        v.push(value(depth + 1));
        if (peek() == ',') {
          ++i_;
          continue;
        }
        expect(']');
        return v;
      }
    }
    if (c == '"') return Value(string());
    if (c == '-' || (c >= '0' && c <= '9')) return number();
    if (c == 't') {
      word("true");
      return Value(true);
    }
    if (c == 'f') {
      word("false");
      return Value(false);
    }
    word("null");
    return Value();
  }

  std::string_view s_;
  const std::string& what_;
  size_t i_ = 0;
};

std::string keyText(std::string_view key) { return key.empty() ? std::string("the value") : str("\"", key, "\""); }

}  // namespace

const char* kindName(Value::Kind kind) {
  switch (kind) {
    case Value::Kind::Null: return "null";
    case Value::Kind::Bool: return "a boolean";
    case Value::Kind::Number: return "a number";
    case Value::Kind::String: return "a string";
    case Value::Kind::Array: return "an array";
    case Value::Kind::Object: return "an object";
  }
  return "?";
}

Value Value::numberText(std::string text) {
  Value v(Kind::Number);
  v.text_ = std::move(text);
  return v;
}

void Value::wrongKind(const std::string& what, std::string_view key, const char* wanted) const {
  throw InvalidArgument(str(what, ": ", keyText(key), " is ", kindName(kind_), ", not ", wanted));
}

bool Value::asBool(const std::string& what, std::string_view key) const {
  if (kind_ != Kind::Bool) wrongKind(what, key, "a boolean");
  return bool_;
}

int64_t Value::asInt(const std::string& what, std::string_view key) const {
  if (kind_ != Kind::Number) wrongKind(what, key, "an integer");
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(text_.data(), text_.data() + text_.size(), v);
  if (ec != std::errc() || end != text_.data() + text_.size()) {
    throw InvalidArgument(str(what, ": ", keyText(key), " is ", text_, ", not an integer in range"));
  }
  return v;
}

double Value::asDouble(const std::string& what, std::string_view key) const {
  if (kind_ != Kind::Number) wrongKind(what, key, "a number");
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text_.c_str(), &end);
  if (end != text_.c_str() + text_.size() || errno == ERANGE) {
    throw InvalidArgument(str(what, ": ", keyText(key), " is ", text_, ", not a number in range"));
  }
  return v;
}

const std::string& Value::asString(const std::string& what, std::string_view key) const {
  if (kind_ != Kind::String) wrongKind(what, key, "a string");
  return text_;
}

const std::vector<Value>& Value::items(const std::string& what, std::string_view key) const {
  if (kind_ != Kind::Array) wrongKind(what, key, "an array");
  return items_;
}

Value& Value::push(Value item) {
  if (kind_ != Kind::Array) wrongKind("JSON", "", "an array");
  items_.push_back(std::move(item));
  return items_.back();
}

const std::vector<std::pair<std::string, Value>>& Value::members(const std::string& what, std::string_view key) const {
  if (kind_ != Kind::Object) wrongKind(what, key, "an object");
  return members_;
}

const Value* Value::find(std::string_view key) const {
  if (kind_ != Kind::Object) return nullptr;
  for (const auto& [k, v] : members_) {
    if (k == key) return &v;
  }
  return nullptr;
}

const Value& Value::get(std::string_view key, const std::string& what) const {
  if (kind_ != Kind::Object) wrongKind(what, "", "an object");
  const Value* v = find(key);
  if (v == nullptr) throw InvalidArgument(str(what, " has no \"", key, "\""));
  return *v;
}

Value& Value::set(std::string key, Value value) {
  if (kind_ != Kind::Object) wrongKind("JSON", "", "an object");
  for (auto& [k, v] : members_) {
    if (k == key) {
      v = std::move(value);
      return v;
    }
  }
  members_.emplace_back(std::move(key), std::move(value));
  return members_.back().second;
}

void Value::write(std::string& out, int indent, int depth) const {
  const auto newline = [&](int level) {
    if (indent < 0) return;
    out += '\n';
    out.append(static_cast<size_t>(indent * level), ' ');
  };
  switch (kind_) {
    case Kind::Null: out += "null"; return;
    case Kind::Bool: out += bool_ ? "true" : "false"; return;
    case Kind::Number: out += text_; return;
    case Kind::String:
      out += '"';
      out += jsonEscape(text_);
      out += '"';
      return;
    case Kind::Array:
      out += '[';
      for (size_t i = 0; i < items_.size(); ++i) {
        if (i) out += indent < 0 ? "," : ", ";
        items_[i].write(out, -1, depth + 1);  // arrays stay on one line: shapes, offsets
      }
      out += ']';
      return;
    case Kind::Object:
      out += '{';
      for (size_t i = 0; i < members_.size(); ++i) {
        if (i) out += ',';
        newline(depth + 1);
        out += '"';
        out += jsonEscape(members_[i].first);
        out += indent < 0 ? "\":" : "\": ";
        members_[i].second.write(out, indent, depth + 1);
      }
      if (!members_.empty()) newline(depth);
      out += '}';
      return;
  }
}

std::string Value::dump(int indent) const {
  std::string out;
  write(out, indent, 0);
  return out;
}

Value parse(std::string_view text, const std::string& what) { return Parser(text, what).document(); }

}  // namespace dt::json
