// A private directory for a same-host socket (mode 0700, as the transport requires), removed with
// everything in it when the test ends.
#pragma once

#include <errno.h>
#include <stdlib.h>

#include <filesystem>
#include <stdexcept>
#include <string>
#include <system_error>

namespace shadowsync::testing {

class SocketDir {
 public:
  // `prefix`: the directory's name before its random suffix, under /tmp.
  explicit SocketDir(const std::string& prefix) {
    std::string name = "/tmp/" + prefix + "_XXXXXX";
    if (::mkdtemp(name.data()) == nullptr) {
      throw std::runtime_error("mkdtemp " + name + ": " +
                               std::error_code(errno, std::generic_category()).message());
    }
    dir_ = name;
  }
  ~SocketDir() {
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }
  SocketDir(const SocketDir&) = delete;
  SocketDir& operator=(const SocketDir&) = delete;

  std::string path() const { return (dir_ / "trainer.sock").string(); }

 private:
  std::filesystem::path dir_;
};

}  // namespace shadowsync::testing
