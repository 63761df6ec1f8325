#include "control/control_handshake.h"

#include <iterator>
#include <utility>
#include <variant>

#include "control/control_auth.h"

namespace shadowsync::control {

Handshake::Handshake(Connection& connection, std::string_view token,
                     std::function<ControlMessage()> local_hello)
    : connection_(connection),
      token_(token),
      local_hello_(std::move(local_hello)),
      stage_(connection.role() == Role::kEngine ? Stage::kClientProof : Stage::kChallenge),
      local_nonce_(make_nonce()) {}

void Handshake::start(Clock::time_point deadline) {
  if (connection_.role() == Role::kEngine) {
    connection_.send(ChallengeMessage{local_nonce_}, deadline);
  }
}

Handshake::Step Handshake::on_message(const ControlMessage& message, Clock::time_point deadline) {
  switch (stage_) {
    case Stage::kChallenge:  // trainer
      if (const auto* challenge = std::get_if<ChallengeMessage>(&message)) {
        engine_nonce_ = challenge->engine_nonce;
        connection_.send(
            ClientProofMessage{local_nonce_, trainer_proof(token_, engine_nonce_, local_nonce_)},
            deadline);
        stage_ = Stage::kServerProof;
        return Step::kContinue;
      }
      break;
    case Stage::kClientProof:  // engine
      if (const auto* proof = std::get_if<ClientProofMessage>(&message)) {
        const ControlNonce& trainer_nonce = proof->trainer_nonce;
        if (!macs_equal(trainer_proof(token_, local_nonce_, trainer_nonce), proof->proof)) {
          return Step::kRefused;
        }
        connection_.send(ServerProofMessage{engine_proof(token_, local_nonce_, trainer_nonce)},
                         deadline);
        connection_.start_session(derive_session_keys(token_, local_nonce_, trainer_nonce));
        stage_ = Stage::kHello;
        connection_.send(local_hello_(), deadline);
        return Step::kContinue;
      }
      break;
    case Stage::kServerProof:  // trainer
      if (const auto* proof = std::get_if<ServerProofMessage>(&message)) {
        if (!macs_equal(engine_proof(token_, engine_nonce_, local_nonce_), proof->proof)) {
          return Step::kRefused;
        }
        connection_.start_session(derive_session_keys(token_, engine_nonce_, local_nonce_));
        stage_ = Stage::kHello;
        return Step::kContinue;
      }
      break;
    case Stage::kHello: {
      const bool hello = connection_.role() == Role::kEngine
                             ? std::holds_alternative<TrainerHelloMessage>(message)
                             : std::holds_alternative<EngineHelloMessage>(message);
      if (hello) {
        stage_ = Stage::kAccept;
        return Step::kPeerHello;
      }
      break;
    }
    case Stage::kAccept:
    case Stage::kDone:
      break;
  }
  return Step::kUnexpected;
}

void Handshake::accept(Clock::time_point deadline) {
  if (connection_.role() == Role::kTrainer) connection_.send(local_hello_(), deadline);
  stage_ = Stage::kDone;
}

std::string_view Handshake::awaiting() const {
  // Indexed by Stage.
  static constexpr std::string_view kAwaiting[] = {
      "the challenge", "the trainer's proof", "the engine's proof",
      "the hello",     "the layout check",    "nothing (the handshake is done)"};
  static_assert(std::size(kAwaiting) == static_cast<std::size_t>(Stage::kDone) + 1);
  return kAwaiting[static_cast<std::size_t>(stage_)];
}

}  // namespace shadowsync::control
