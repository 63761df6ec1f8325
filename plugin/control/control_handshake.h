// The handshake that opens every control connection, one implementation for both roles (the
// messages and why they are safe: control_auth.h):
//
//   engine  -> trainer  challenge
//   trainer -> engine   client_proof   (the engine checks it)
//   engine  -> trainer  server_proof   (the trainer checks it; from here on every frame is tagged)
//   engine  -> trainer  engine_hello   (the trainer checks it against its layout)
//   trainer -> engine   trainer_hello  (the engine checks it against its layout)
//
// It runs no I/O loop of its own: the engine feeds it the frames its poll loop reads, the trainer
// the frames it reads with blocking receives; it sends its answers on the connection itself.
// Whether a hello's layout matches is the endpoint's call (kPeerHello, then accept()).
//
// Not thread-safe: used by the thread that reads the connection.
#pragma once

#include <functional>
#include <string_view>

#include "control/control_connection.h"
#include "control/control_frame.h"

namespace shadowsync::control {

class Handshake {
 public:
  enum class Step {
    kContinue,    // answered as the protocol says; wait for the peer's next frame
    kPeerHello,   // that frame is the peer's hello: check it, then accept() (or close)
    kRefused,     // the peer's proof is wrong: a different token, or a replayed handshake
    kUnexpected,  // a frame that does not belong at this point of the handshake
  };

  // `connection` (not yet in a session) and `token` must outlive this. `local_hello` makes this
  // side's hello when the protocol sends it: the engine's right after the proofs (so it reports
  // what is live then), the trainer's in accept(). Draws this side's nonce: throws Error(kInternal)
  // when the random generator fails.
  Handshake(Connection& connection, std::string_view token,
            std::function<ControlMessage()> local_hello);

  // Engine: sends the challenge that opens the handshake. Trainer: nothing to do.
  void start(Clock::time_point deadline);

  // One frame from the peer; the answer, if any, is written before `deadline`. Throws what
  // Connection::send throws; the connection is then unusable.
  Step on_message(const ControlMessage& message, Clock::time_point deadline);

  // After kPeerHello, once the endpoint accepted the peer's hello: the trainer sends its own
  // hello (before `deadline`); the handshake is done. Throws what Connection::send throws.
  void accept(Clock::time_point deadline);

  // What the handshake waits for ("the challenge", "the engine's proof", "the hello"), for
  // error messages.
  std::string_view awaiting() const;
  bool done() const { return stage_ == Stage::kDone; }
  // Engine: the trainer's proof was checked and matched (it holds the token).
  bool peer_proved() const { return stage_ != Stage::kClientProof && stage_ != Stage::kChallenge; }

 private:
  enum class Stage { kChallenge, kClientProof, kServerProof, kHello, kAccept, kDone };

  Connection& connection_;
  std::string_view token_;
  std::function<ControlMessage()> local_hello_;
  Stage stage_;
  ControlNonce local_nonce_;
  ControlNonce engine_nonce_{};  // the trainer's copy of the challenge
};

}  // namespace shadowsync::control
