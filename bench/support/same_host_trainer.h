// bench_same_host_one_gpu's trainer process (--role trainer): it holds the model's source tensors,
// serves the same-host transport and publishes through a Sender, each step when the engine asks.
// Commands, one per line on --command-fd; one reply line each on --reply-fd
// (same_host_protocol.h):
//   ready (sent once, unasked, when the CUDA context exists)
//   model NAME full|shared  the model's layout and source tensors      -> source_bytes
//   serve PATH              SameHostTransport::serve, kDevice          -> ms, free_*, backend_delta
//   send                    every bucket from the staging slots         -> ms, chunks
//   timeline                the transport's per-chunk medians since the last "timeline"
//   sender                  a Sender over the transport                 -> free_*, backend_delta
//   publish V               Sender::publish of every group, waited for  -> ms, backend_bytes
//   close                   everything of the model freed
//   quit
// CUDA builds only.
#pragma once

#include "same_host_options.h"

namespace shadowsync::bench::same_host {

// Serves the engine's commands until "quit" or until the engine goes away; the exit status.
int trainer_main(const Options& o);

}  // namespace shadowsync::bench::same_host
