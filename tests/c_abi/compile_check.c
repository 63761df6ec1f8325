/* The C ABI from C: shadowsync.h must compile as strict C11 (-std=c11 -Wall -Wextra -Werror
 * -pedantic), and a plain C program linked against libshadowsync_c must be able to run an update
 * end to end: layout, host backend, loopback transport, receiver, sender, step hook. Also checks
 * that NULL handles and uninitialized config structs come back as statuses, not crashes.
 * Exits 0 on success, 1 with a message on the first failed check. */
#include "shadowsync/shadowsync.h"

#include <stdio.h>
#include <string.h>

static int failures = 0;

#define CHECK(condition)                                                                   \
  do {                                                                                     \
    if (!(condition)) {                                                                    \
      fprintf(stderr, "%s:%d: CHECK failed: %s (last error: %s)\n", __FILE__, __LINE__,   \
              #condition, shadowsync_get_last_error());                                    \
      ++failures;                                                                          \
      return 1;                                                                            \
    }                                                                                      \
  } while (0)

#define OK(call) CHECK((call) == SHADOWSYNC_SUCCESS)

static int check_errors(void) {
  int s;
  shadowsync_receiver_config_t garbage;
  shadowsync_layout_t layout = NULL;

  for (s = 0; s <= SHADOWSYNC_NUM_RESULTS; ++s) {
    CHECK(shadowsync_get_error_string((shadowsync_status_t)s) != NULL);
  }
  CHECK(shadowsync_get_c_api_version() == SHADOWSYNC_C_API_VERSION);

  /* NULL handles are statuses. */
  CHECK(shadowsync_receiver_begin_update_bytes(NULL, "x", 1) == SHADOWSYNC_INVALID_HANDLE);
  CHECK(shadowsync_receiver_before_step(NULL, NULL, NULL) == SHADOWSYNC_INVALID_HANDLE);
  CHECK(shadowsync_publish_wait(NULL, 0) == SHADOWSYNC_INVALID_HANDLE);
  CHECK(strstr(shadowsync_get_last_error(), "NULL shadowsync_publish_t") != NULL);
  CHECK(shadowsync_layout_destroy(NULL) == SHADOWSYNC_INVALID_HANDLE);

  /* An uninitialized config struct is refused before anything is made. */
  memset(&garbage, 0x5a, sizeof garbage);
  CHECK(shadowsync_receiver_create(layout, NULL, NULL, &garbage, NULL) != SHADOWSYNC_SUCCESS);
  return 0;
}

static int run_update(void) {
  const int64_t shape_w[2] = {16, 33};
  const int64_t shape_b[1] = {7};
  const shadowsync_tensor_spec_t specs[2] = {
      {"w", "fp32", shape_w, 2, NULL},
      {"b", "float16", shape_b, 1, "base"},
  };
  float w[16 * 33];
  uint16_t b[7];
  const shadowsync_source_tensor_t tensors[2] = {
      {"w", w, "float32", shape_w, 2},
      {"b", b, "fp16", shape_b, 1},
  };
  const char* groups[1] = {"base"};
  shadowsync_receiver_config_t rconfig = SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER;
  shadowsync_sender_config_t sconfig = SHADOWSYNC_SENDER_CONFIG_INITIALIZER;
  shadowsync_receiver_stats_t stats = SHADOWSYNC_RECEIVER_STATS_INITIALIZER;
  shadowsync_layout_t layout;
  shadowsync_backend_t backend;
  shadowsync_stream_t engine_stream;
  shadowsync_loopback_t loopback;
  shadowsync_transport_t t0, t1;
  shadowsync_receiver_t receiver;
  shadowsync_sender_t sender;
  shadowsync_publish_t publish;
  unsigned char header[SHADOWSYNC_MAX_HEADER_BYTES];
  size_t header_bytes = 0;
  shadowsync_update_header_t header_struct = SHADOWSYNC_UPDATE_HEADER_INITIALIZER;
  uint64_t applied = 0;
  void* live = NULL;
  size_t i;

  for (i = 0; i < 16 * 33; ++i) w[i] = (float)i * 0.5f;
  for (i = 0; i < 7; ++i) b[i] = (uint16_t)(0x3c00 + i);

  OK(shadowsync_layout_create(specs, 2, 1024, &layout));
  OK(shadowsync_host_backend_create(&backend));
  OK(shadowsync_stream_create(backend, 0, &engine_stream));
  OK(shadowsync_loopback_create(2, &loopback));
  OK(shadowsync_loopback_transport(loopback, 0, &t0));
  OK(shadowsync_loopback_transport(loopback, 1, &t1));
  rconfig.update_deadline_ms = 20000;
  rconfig.swap_strategy = SHADOWSYNC_SWAP_REBIND; /* the appended fields compile as C11 */
  rconfig.engine_uses_cuda_graphs = 0;
  rconfig.decode_slowdown_budget = 4.0; /* paced: the step hook stamps each step */
  rconfig.max_receive_bytes_per_second = 0;
  rconfig.gated_swaps = 0;
  rconfig.gate_deadline_ms = 50;
  OK(shadowsync_receiver_create(layout, backend, t1, &rconfig, &receiver));
  OK(shadowsync_sender_create(layout, backend, t0, &sconfig, &sender));
  /* The transports were taken. */
  CHECK(shadowsync_transport_destroy(t0) == SHADOWSYNC_INVALID_HANDLE);

  OK(shadowsync_sender_publish(sender, 1, groups, 1, tensors, 2, &publish));
  OK(shadowsync_publish_header_bytes(publish, header, sizeof header, &header_bytes));
  /* The versioned header struct, filled by the library, as C11. */
  OK(shadowsync_publish_header(publish, &header_struct));
  CHECK(header_struct.size == sizeof header_struct && header_struct.version == 1 &&
        header_struct.group_count == 1 && header_struct.groups[0] == 0);
  OK(shadowsync_receiver_begin_update_bytes(receiver, header, header_bytes));
  OK(shadowsync_publish_wait(publish, 20000));
  OK(shadowsync_receiver_wait_applied(receiver, 1, 20000, engine_stream));
  OK(shadowsync_receiver_applied_version(receiver, &applied));
  CHECK(applied == 1);
  OK(shadowsync_receiver_live_tensor_by_name(receiver, "w", &live));
  CHECK(memcmp(live, w, sizeof w) == 0);
  OK(shadowsync_receiver_live_tensor(receiver, 0, 1, &live));
  CHECK(memcmp(live, b, sizeof b) == 0);
  OK(shadowsync_receiver_before_step(receiver, engine_stream, &applied));
  CHECK(applied == 0); /* nothing pending: the fast path */
  OK(shadowsync_receiver_stats(receiver, &stats));
  CHECK(stats.updates_ready == 1 && stats.applied_version == 1);
  CHECK(stats.stuck_aborts == 0 && stats.last_failed_version == 0 && stats.last_failed_group == -1);
  CHECK(stats.last_paced == 1 && stats.last_pacing_budget == 4.0 && stats.last_transfer_ns > 0);
  OK(shadowsync_receiver_rollback(receiver, engine_stream, &applied)); /* back to the zero slots */
  CHECK(applied == 1);

  OK(shadowsync_publish_destroy(publish));
  OK(shadowsync_sender_destroy(sender));
  OK(shadowsync_receiver_destroy(receiver));
  CHECK(shadowsync_receiver_destroy(receiver) == SHADOWSYNC_INVALID_HANDLE);
  OK(shadowsync_stream_destroy(engine_stream));
  OK(shadowsync_loopback_destroy(loopback));
  OK(shadowsync_backend_destroy(backend));
  OK(shadowsync_layout_destroy(layout));
  return 0;
}

int main(void) {
  if (check_errors() != 0 || run_update() != 0) return 1;
  printf("C ABI from C11: OK (cuda in this build: %d)\n", shadowsync_has_cuda());
  return failures == 0 ? 0 : 1;
}
