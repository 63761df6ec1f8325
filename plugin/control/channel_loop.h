// The I/O loop both ends of the control channel run on their I/O thread: one poll over a wake-up
// pipe, the listening socket (engine) and every open connection. It reads what each connection
// holds, splits it into verified frames (Connection::next) and hands them to the endpoint; it
// enforces the handshake deadline and the per-frame read deadline; it backs off when accept
// fails. What a frame means is the endpoint's business (LoopHandler). Writes do not go through
// the loop: Connection::send writes with its own deadline on whichever thread sends.
#pragma once

#include <atomic>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "control/control_connection.h"
#include "control/control_frame.h"
#include "control/control_socket.h"
#include "shadowsync/control_channel.h"

namespace shadowsync::control {

// Writes one line to config.log, or "shadowsync control: ..." on stderr. Thread-safe if the log
// sink is (ControlConfig::log must be).
void log_line(const ControlConfig& config, const std::string& line);

// One connection as the loop sees it. An endpoint keeps its per-peer state in a type derived from
// it and owns it; the loop only borrows it for a turn (LoopHandler::collect).
struct Link {
  virtual ~Link() = default;
  std::unique_ptr<Connection> connection;
  // While the handshake runs, when it must be over; the loop closes the connection then.
  // time_point::max(): no handshake pending.
  Clock::time_point handshake_deadline = Clock::time_point::max();
};

// Why the loop gives up on a connection.
enum class LinkFailure {
  kClosed,    // the peer closed the connection, or reading it failed
  kProtocol,  // a frame that is malformed, fails its tag or belongs to another role or phase;
              // or the handshake or a frame was not completed within its deadline
};

// The endpoint's side of the loop. Every call comes from the thread in ChannelLoop::run.
class LoopHandler {
 public:
  virtual ~LoopHandler() = default;
  // The connections to poll now: every open one. Called at the start of each turn and again
  // before the deadlines are checked (connections accepted during the turn are checked too).
  virtual void collect(std::vector<Link*>& links) = 0;
  // Whether `link` is still open: an earlier call of this turn may have closed it.
  virtual bool is_open(const Link& link) const = 0;
  // A complete frame, verified as far as Connection::next verifies (role, phase, tag, fields).
  virtual void on_message(Link& link, ControlMessage& message) = 0;
  // The loop gives up on `link`: close it, saying `why`. Nothing more is read from it this turn.
  virtual void on_failure(Link& link, LinkFailure failure, const std::string& why) = 0;
  // A connection accepted on the listener (non-blocking, close-on-exec); `peer` is its address.
  virtual void on_accept(Fd fd, const std::string& peer);
  // Bytes read from the wake-up pipe, in the order ChannelLoop::notify wrote them. A record may
  // be split across two calls.
  virtual void on_wake(std::span<const std::byte> bytes);
  // Each turn, after the reads and before the deadlines are checked.
  virtual void after_reads();
  // The end of each turn: the place to forget closed connections.
  virtual void end_turn();
};

class ChannelLoop {
 public:
  // Creates the wake-up pipe (throws Error(kTransport) if it cannot). `config` supplies the
  // deadlines and the log, and must outlive this. `poll_failure_note` ends the log line of a
  // failed poll, which ends run() ("the control channel stops").
  ChannelLoop(const ControlConfig& config, std::string poll_failure_note);

  // Polls `listener` too and passes each accepted connection to LoopHandler::on_accept. Call
  // before run().
  void listen(Fd listener);

  // Runs turns on the calling thread (the endpoint's I/O thread) until stop(). One turn: poll
  // until something is ready or the nearest deadline; drain the wake-up pipe; accept; read every
  // ready connection; after_reads(); close the connections past a deadline; end_turn().
  void run(LoopHandler& handler);

  // Makes run() return before its next turn: sets the flag, then writes `wake_record` (as
  // notify() does) so that a poll in progress returns. Thread-safe; never blocks.
  void stop(std::span<const std::byte> wake_record) noexcept;
  bool stopping() const noexcept { return stopping_.load(); }

  // Writes `record` (at most PIPE_BUF bytes: whole or not at all) to the wake-up pipe; run()
  // reads it back into LoopHandler::on_wake. Never blocks and does not allocate. False when the
  // pipe is full. Any thread.
  bool notify(std::span<const std::byte> record) noexcept;

 private:
  void drain_wake_pipe(LoopHandler& handler);
  void accept_all(LoopHandler& handler);
  void read(LoopHandler& handler, Link& link);
  void check_deadlines(LoopHandler& handler, const std::vector<Link*>& links);

  const ControlConfig& config_;
  std::string poll_failure_note_;
  Fd wake_read_;
  Fd wake_write_;
  Fd listener_;
  std::atomic<bool> stopping_{false};
  // run()'s thread only.
  Clock::time_point accept_resume_{};
};

}  // namespace shadowsync::control
