// The control handshake, one implementation for both roles: an engine-role and a trainer-role
// Handshake talk to each other over a socket pair, and every frame after it is tagged and
// verifies; a different token or a frame out of place is refused.
#include <sys/socket.h>

#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <variant>

#include "control/control_connection.h"
#include "control/control_frame.h"
#include "control/control_handshake.h"

using namespace shadowsync;
using control::Connection;
using control::Handshake;

namespace {

const std::string kEngineToken = "ssk1-e6847ed44259b1c45659e56b5c0334695c4754ed3e36b1307c16f0d2450b0ffe";

struct Pair {
  std::unique_ptr<Connection> engine;
  std::unique_ptr<Connection> trainer;
};

Pair connected_pair() {
  int fds[2];
  REQUIRE(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0, fds) == 0);
  return {std::make_unique<Connection>(control::Fd(fds[0]), "trainer", control::Role::kEngine),
          std::make_unique<Connection>(control::Fd(fds[1]), "engine", control::Role::kTrainer)};
}

control::Clock::time_point soon() { return control::Clock::now() + std::chrono::seconds(10); }

EngineHelloMessage engine_hello() {
  EngineHelloMessage hello;
  hello.rank = 3;
  hello.layout_fingerprint = 0xabc;
  hello.applied_version = 7;
  hello.groups = {{"base", 4}};
  return hello;
}

TrainerHelloMessage trainer_hello() {
  TrainerHelloMessage hello;
  hello.layout_fingerprint = 0xabc;
  hello.groups = {{"base", 4}};
  return hello;
}

}  // namespace

TEST_CASE("an engine and a trainer complete the handshake and then exchange tagged frames") {
  Pair pair = connected_pair();
  Handshake engine(*pair.engine, kEngineToken, [] { return ControlMessage(engine_hello()); });
  Handshake trainer(*pair.trainer, kEngineToken, [] { return ControlMessage(trainer_hello()); });
  CHECK(trainer.awaiting() == "the challenge");

  engine.start(soon());
  CHECK(trainer.on_message(pair.trainer->receive(soon()), soon()) == Handshake::Step::kContinue);
  CHECK(trainer.awaiting() == "the engine's proof");
  CHECK(engine.on_message(pair.engine->receive(soon()), soon()) == Handshake::Step::kContinue);
  CHECK(pair.engine->in_session());
  CHECK(trainer.on_message(pair.trainer->receive(soon()), soon()) == Handshake::Step::kContinue);
  CHECK(pair.trainer->in_session());
  CHECK(trainer.awaiting() == "the hello");

  // The engine's hello, tagged, made when the protocol sends it.
  const ControlMessage from_engine = pair.trainer->receive(soon());
  REQUIRE(std::holds_alternative<EngineHelloMessage>(from_engine));
  CHECK(std::get<EngineHelloMessage>(from_engine).applied_version == 7);
  CHECK(trainer.on_message(from_engine, soon()) == Handshake::Step::kPeerHello);
  CHECK_FALSE(trainer.done());
  trainer.accept(soon());  // sends the trainer's hello
  CHECK(trainer.done());

  const ControlMessage from_trainer = pair.engine->receive(soon());
  REQUIRE(std::holds_alternative<TrainerHelloMessage>(from_trainer));
  CHECK(engine.on_message(from_trainer, soon()) == Handshake::Step::kPeerHello);
  engine.accept(soon());
  CHECK(engine.done());

  // Both sides hold the same session keys: frames either way verify.
  pair.trainer->send(AbortMessage{5, "test"}, soon());
  const ControlMessage abort = pair.engine->receive(soon());
  REQUIRE(std::holds_alternative<AbortMessage>(abort));
  CHECK(std::get<AbortMessage>(abort).version == 5);
  pair.engine->send(AckMessage{5, 11}, soon());
  const ControlMessage ack = pair.trainer->receive(soon());
  REQUIRE(std::holds_alternative<AckMessage>(ack));
  CHECK(std::get<AckMessage>(ack).engine_step == 11);
}

TEST_CASE("each side refuses the other's proof when their tokens differ") {
  SECTION("the engine checks the trainer's proof") {
    Pair pair = connected_pair();
    Handshake engine(*pair.engine, kEngineToken, [] { return ControlMessage(engine_hello()); });
    Handshake trainer(*pair.trainer, "ssk1-25dd3db5c9cefddb744a2175b1dc872d32dc42344bd60b57a8036aaa30ee2c93",
                      [] { return ControlMessage(trainer_hello()); });
    engine.start(soon());
    CHECK(trainer.on_message(pair.trainer->receive(soon()), soon()) == Handshake::Step::kContinue);
    CHECK(engine.on_message(pair.engine->receive(soon()), soon()) == Handshake::Step::kRefused);
    CHECK_FALSE(pair.engine->in_session());
  }
  SECTION("the trainer checks the engine's proof") {
    // A forged server proof, as an engine without the token would have to send it.
    Pair pair = connected_pair();
    Handshake trainer(*pair.trainer, kEngineToken, [] { return ControlMessage(trainer_hello()); });
    pair.engine->send(ChallengeMessage{}, soon());
    CHECK(trainer.on_message(pair.trainer->receive(soon()), soon()) == Handshake::Step::kContinue);
    CHECK(trainer.on_message(ServerProofMessage{}, soon()) == Handshake::Step::kRefused);
    CHECK_FALSE(pair.trainer->in_session());
  }
}

TEST_CASE("a frame out of place in the handshake is unexpected") {
  Pair pair = connected_pair();
  Handshake engine(*pair.engine, kEngineToken, [] { return ControlMessage(engine_hello()); });
  Handshake trainer(*pair.trainer, kEngineToken, [] { return ControlMessage(trainer_hello()); });
  CHECK(engine.on_message(GoodbyeMessage{"bye"}, soon()) == Handshake::Step::kUnexpected);
  CHECK(engine.on_message(trainer_hello(), soon()) == Handshake::Step::kUnexpected);
  CHECK(trainer.on_message(ServerProofMessage{}, soon()) == Handshake::Step::kUnexpected);
  CHECK(trainer.on_message(engine_hello(), soon()) == Handshake::Step::kUnexpected);
  CHECK_FALSE(engine.done());
  CHECK_FALSE(trainer.done());
}
