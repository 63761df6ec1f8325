#include "transports/same_host/same_host_dial.h"

#include <array>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <thread>

#include <fmt/format.h>

#include "shadowsync/error.h"
#include "transports/same_host/same_host_auth.h"
#include "transports/same_host/same_host_frame.h"

namespace shadowsync::same_host {

Fd dial(const std::string& path, Clock::time_point deadline, int& last_errno) {
  const std::string directory = std::filesystem::path(path).parent_path().string();
  for (;;) {
    // Again on every attempt: the directory may have been swapped while no sender listened.
    check_private_directory(directory, /*create=*/false);
    Fd socket = try_connect(path);
    if (socket) {
      check_listener_is_this_user(socket.get(), path);
      return socket;
    }
    last_errno = errno;
    if (last_errno != ENOENT && last_errno != ECONNREFUSED && last_errno != EAGAIN) {
      throw Error(ErrorCode::kTransport,
                  fmt::format("same-host connect to '{}': {}", path, std::strerror(last_errno)));
    }
    if (Clock::now() >= deadline) return Fd();
    // No sender yet (or a stale file of a dead one): poll for the next one.
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void prove_to_sender(int fd, const std::string& path, std::string_view token, std::uint32_t rank,
                     Clock::time_point deadline) {
  const auto failed = [&](const std::string& what, Io io) {
    return Error(io == Io::kTimeout ? ErrorCode::kTimeout : ErrorCode::kTransport,
                 fmt::format("same-host connect to '{}' as rank {}: {}: {}", path, rank, what,
                             describe(io, errno)));
  };
  std::array<std::byte, 40> challenge_record{};
  if (const Io io = read_exact(fd, challenge_record, -1, deadline); io != Io::kOk) {
    throw failed("waiting for the sender's challenge", io);
  }
  std::string problem;
  Challenge challenge;
  if (!decode(challenge_record, challenge, problem)) {
    throw Error(ErrorCode::kTransport, fmt::format("same-host connect to '{}': {}", path, problem));
  }
  Proof proof;
  proof.rank = rank;
  proof.receiver_nonce = make_nonce();
  proof.mac = receiver_proof(token, challenge.sender_nonce, proof.receiver_nonce, proof.rank);
  if (const Io io = write_all(fd, encode(proof), -1, deadline); io != Io::kOk) {
    throw failed("sending the proof", io);
  }
  std::array<std::byte, 40> answer{};
  const std::span<std::byte> head(answer.data(), kHeaderBytes);
  if (const Io io = read_exact(fd, head, -1, deadline); io != Io::kOk) {
    throw failed("waiting for the sender's answer", io);
  }
  RecordType type{};
  if (!parse_record_header(head, type, problem)) {
    throw Error(ErrorCode::kTransport, fmt::format("same-host connect to '{}': {}", path, problem));
  }
  if (type == RecordType::kRefuse) {
    const std::span<std::byte> rest(answer.data() + kHeaderBytes, 8);
    Refuse refuse;
    if (read_exact(fd, rest, -1, deadline) == Io::kOk &&
        decode(std::span<const std::byte>(answer.data(), 16), refuse, problem)) {
      problem = to_string(refuse.reason);
    }
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}' as rank {}: the sender refused: {}", path,
                            rank, problem));
  }
  if (type != RecordType::kAccept) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': record type {} where the sender's proof "
                            "was expected",
                            path, static_cast<int>(type)));
  }
  const std::span<std::byte> rest(answer.data() + kHeaderBytes, answer.size() - kHeaderBytes);
  if (const Io io = read_exact(fd, rest, -1, deadline); io != Io::kOk) {
    throw failed("reading the sender's proof", io);
  }
  Accept accept;
  if (!decode(answer, accept, problem)) {
    throw Error(ErrorCode::kTransport, fmt::format("same-host connect to '{}': {}", path, problem));
  }
  if (!macs_equal(accept.mac,
                  sender_proof(token, challenge.sender_nonce, proof.receiver_nonce, proof.rank))) {
    throw Error(ErrorCode::kTransport,
                fmt::format("same-host connect to '{}': the sender could not prove the token "
                            "(wrong token, or not our sender); refusing it before any memory is "
                            "shared",
                            path));
  }
  if (const Io io = write_all(fd, encode_ready(), -1, deadline); io != Io::kOk) {
    throw failed("sending ready", io);
  }
}

}  // namespace shadowsync::same_host
