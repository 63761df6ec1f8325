// The checks of a ReceiverConfig against its transport and backend, run by the Receiver's
// constructor before it allocates anything. Each throws Error(kInvalidArgument) naming the field,
// its value and, where there is one, what to use instead.
#pragma once

#include "shadowsync/backend.h"
#include "shadowsync/receiver.h"
#include "shadowsync/transport.h"

namespace shadowsync {

// `transport` may be null (the rendezvous is not done yet): the root rank is then only checked
// for being non-negative.
void check_receiver_config(const ReceiverConfig& config, const Transport* transport,
                           const Backend& backend);

}  // namespace shadowsync
