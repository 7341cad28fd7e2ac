#include "launcher/output.h"

#include <cerrno>
#include <unistd.h>

#include "common/strings.h"

namespace dt::launcher {

void LineSplitter::feed(std::string_view bytes, std::vector<std::string>& lines) {
  while (!bytes.empty()) {
    const auto nl = bytes.find('\n');
    const auto take = nl == std::string_view::npos ? bytes.size() : nl;
    partial_.append(bytes.substr(0, take));
    while (partial_.size() >= maxLine_) {
      lines.push_back(partial_.substr(0, maxLine_));
      partial_.erase(0, maxLine_);
    }
    if (nl == std::string_view::npos) break;
    lines.push_back(std::move(partial_));
    partial_.clear();
    bytes.remove_prefix(nl + 1);
  }
}

void LineSplitter::flush(std::vector<std::string>& lines) {
  if (!partial_.empty()) lines.push_back(std::move(partial_));
  partial_.clear();
}

std::string expandPrefix(const std::string& format, int rank, int localRank, int nodeRank, const std::string& host) {
  std::string out;
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%' || i + 1 == format.size()) {
      out += format[i];
      continue;
    }
    switch (format[++i]) {
      case 'r': out += str(rank); break;
      case 'l': out += str(localRank); break;
      case 'n': out += str(nodeRank); break;
      case 'h': out += host; break;
      case '%': out += '%'; break;
      default: out += '%'; out += format[i];
    }
  }
  return out;
}

void writeAll(int fd, std::string_view data) {
  while (!data.empty()) {
    const ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return;
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
}

OutputStream::~OutputStream() {
  if (target_.fileFd >= 0) ::close(target_.fileFd);
}

void OutputStream::write(std::string_view bytes) {
  // The file gets the raw bytes, exactly as the worker wrote them.
  if (target_.fileFd >= 0) writeAll(target_.fileFd, bytes);
  if (target_.consoleFd < 0 && !target_.keepTail) return;
  std::vector<std::string> lines;
  splitter_.feed(bytes, lines);
  emit(lines);
}

void OutputStream::finish() {
  std::vector<std::string> lines;
  splitter_.flush(lines);
  emit(lines);
  if (target_.fileFd >= 0) {
    ::close(target_.fileFd);
    target_.fileFd = -1;
  }
}

void OutputStream::emit(const std::vector<std::string>& lines) {
  if (lines.empty()) return;
  if (target_.consoleFd >= 0) {
    // One buffer, one write: a pipe/terminal write of up to PIPE_BUF is atomic
    // and dtrun is the only writer, so lines never interleave.
    std::string buffer;
    for (const auto& line : lines) {
      buffer += target_.prefix;
      buffer += line;
      buffer += '\n';
    }
    writeAll(target_.consoleFd, buffer);
  }
  if (target_.keepTail) {
    for (const auto& line : lines) {
      tail_.push_back(line.size() > 400 ? line.substr(0, 400) + "..." : line);
      if (tail_.size() > tailLines_) tail_.pop_front();
    }
  }
}

}  // namespace dt::launcher
