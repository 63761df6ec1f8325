/* The C ABI's layout as JSON on stdout: for each struct of shadowsync.h its size and, per field,
 * offset, size and element type; the status values; the constants. python/tests/test_abi_mirror.py
 * compiles this file against include/ and compares every number with the ctypes mirrors of the
 * Python package (shadowsync/_library.py, shadowsync/errors.py), so a mirror that drifts from the
 * header fails there. A struct or field added to shadowsync.h must be added here as well.
 * As a c_abi ctest it checks that the header compiles as strict C11; it calls no function. */
#include "shadowsync/shadowsync.h"

#include <stddef.h>
#include <stdio.h>

/* The element type of a field, in the names the Python test maps ctypes types to. size_t is
 * uint64 here: on the LP64 platforms the package supports it is the same type. */
#define TYPE_NAME(x)             \
  _Generic((x),                  \
      int32_t: "int32",          \
      uint32_t: "uint32",        \
      int64_t: "int64",          \
      uint64_t: "uint64",        \
      double: "double",          \
      const char*: "char_p",     \
      const void*: "void_p",     \
      const int64_t*: "int64_p", \
      const shadowsync_wire_range_t*: "wire_range_p", \
      shadowsync_tensor_region_t: "tensor_region", \
      default: "unknown")

static int first_item;

static void begin_struct(const char* name, size_t size) {
  printf("%s\n    \"%s\": {\"size\": %zu, \"fields\": [", first_item ? "" : ",", name, size);
  first_item = 1;
}

static void field(const char* name, size_t offset, size_t size, const char* type) {
  printf("%s\n      {\"name\": \"%s\", \"offset\": %zu, \"size\": %zu, \"type\": \"%s\"}",
         first_item ? "" : ",", name, offset, size, type);
  first_item = 0;
}

static void end_struct(void) { printf("\n    ]}"); }

static void constant(const char* name, long long value) {
  printf("%s\n    \"%s\": %lld", first_item ? "" : ",", name, value);
  first_item = 0;
}

/* A field of struct type T; arrays report their element type, and their size the whole array. */
#define FIELD(T, f) field(#f, offsetof(T, f), sizeof(((T*)0)->f), TYPE_NAME(((T*)0)->f))
#define ARRAY_FIELD(T, f) field(#f, offsetof(T, f), sizeof(((T*)0)->f), TYPE_NAME(((T*)0)->f[0]))
#define STRUCT(T) begin_struct(#T, sizeof(T))
#define CONSTANT(c) constant(#c, (long long)(c))

static void structs(void) {
  STRUCT(shadowsync_tensor_spec_t);
  FIELD(shadowsync_tensor_spec_t, name);
  FIELD(shadowsync_tensor_spec_t, dtype);
  FIELD(shadowsync_tensor_spec_t, shape);
  FIELD(shadowsync_tensor_spec_t, ndim);
  FIELD(shadowsync_tensor_spec_t, group);
  end_struct();

  STRUCT(shadowsync_group_info_t);
  FIELD(shadowsync_group_info_t, name);
  FIELD(shadowsync_group_info_t, tensor_count);
  FIELD(shadowsync_group_info_t, arena_bytes);
  FIELD(shadowsync_group_info_t, bucket_bytes);
  FIELD(shadowsync_group_info_t, bucket_count);
  end_struct();

  STRUCT(shadowsync_tensor_info_t);
  FIELD(shadowsync_tensor_info_t, name);
  FIELD(shadowsync_tensor_info_t, dtype);
  FIELD(shadowsync_tensor_info_t, shape);
  FIELD(shadowsync_tensor_info_t, ndim);
  FIELD(shadowsync_tensor_info_t, offset);
  FIELD(shadowsync_tensor_info_t, bytes);
  end_struct();

  STRUCT(shadowsync_update_header_t);
  FIELD(shadowsync_update_header_t, size);
  FIELD(shadowsync_update_header_t, struct_magic);
  FIELD(shadowsync_update_header_t, struct_version);
  FIELD(shadowsync_update_header_t, magic);
  FIELD(shadowsync_update_header_t, protocol_version);
  FIELD(shadowsync_update_header_t, version);
  FIELD(shadowsync_update_header_t, layout_fingerprint);
  FIELD(shadowsync_update_header_t, group_count);
  ARRAY_FIELD(shadowsync_update_header_t, groups);
  FIELD(shadowsync_update_header_t, bucket_count);
  end_struct();

  STRUCT(shadowsync_receiver_config_t);
  FIELD(shadowsync_receiver_config_t, size);
  FIELD(shadowsync_receiver_config_t, magic);
  FIELD(shadowsync_receiver_config_t, version);
  FIELD(shadowsync_receiver_config_t, root_rank);
  FIELD(shadowsync_receiver_config_t, update_deadline_ms);
  FIELD(shadowsync_receiver_config_t, bucket_deadline_ms);
  FIELD(shadowsync_receiver_config_t, poll_interval_us);
  FIELD(shadowsync_receiver_config_t, swap_strategy);
  FIELD(shadowsync_receiver_config_t, engine_uses_cuda_graphs);
  FIELD(shadowsync_receiver_config_t, require_checksums);
  FIELD(shadowsync_receiver_config_t, reject_nonfinite);
  FIELD(shadowsync_receiver_config_t, abort_deadline_ms);
  FIELD(shadowsync_receiver_config_t, exit_on_stuck_abort);
  FIELD(shadowsync_receiver_config_t, commit_mode);
  FIELD(shadowsync_receiver_config_t, decode_slowdown_budget);
  FIELD(shadowsync_receiver_config_t, max_receive_bytes_per_second);
  FIELD(shadowsync_receiver_config_t, gated_swaps);
  FIELD(shadowsync_receiver_config_t, gate_deadline_ms);
  FIELD(shadowsync_receiver_config_t, offer_after_clean_step);
  end_struct();

  STRUCT(shadowsync_sender_config_t);
  FIELD(shadowsync_sender_config_t, size);
  FIELD(shadowsync_sender_config_t, magic);
  FIELD(shadowsync_sender_config_t, version);
  FIELD(shadowsync_sender_config_t, root_rank);
  FIELD(shadowsync_sender_config_t, update_deadline_ms);
  FIELD(shadowsync_sender_config_t, poll_interval_us);
  FIELD(shadowsync_sender_config_t, checksums);
  end_struct();

  STRUCT(shadowsync_nccl_config_t);
  FIELD(shadowsync_nccl_config_t, size);
  FIELD(shadowsync_nccl_config_t, magic);
  FIELD(shadowsync_nccl_config_t, version);
  FIELD(shadowsync_nccl_config_t, max_ctas);
  FIELD(shadowsync_nccl_config_t, min_ctas);
  FIELD(shadowsync_nccl_config_t, cga_cluster_size);
  FIELD(shadowsync_nccl_config_t, init_timeout_ms);
  FIELD(shadowsync_nccl_config_t, enqueue_timeout_ms);
  FIELD(shadowsync_nccl_config_t, finalize_timeout_ms);
  end_struct();

  STRUCT(shadowsync_receiver_stats_t);
  FIELD(shadowsync_receiver_stats_t, size);
  FIELD(shadowsync_receiver_stats_t, updates_ready);
  FIELD(shadowsync_receiver_stats_t, updates_failed);
  FIELD(shadowsync_receiver_stats_t, updates_superseded);
  FIELD(shadowsync_receiver_stats_t, bytes_received);
  FIELD(shadowsync_receiver_stats_t, last_accepted_version);
  FIELD(shadowsync_receiver_stats_t, applied_version);
  FIELD(shadowsync_receiver_stats_t, needs_transport);
  FIELD(shadowsync_receiver_stats_t, has_pending);
  FIELD(shadowsync_receiver_stats_t, stuck_aborts);
  FIELD(shadowsync_receiver_stats_t, last_failed_version);
  FIELD(shadowsync_receiver_stats_t, last_failure_status);
  FIELD(shadowsync_receiver_stats_t, last_failed_group);
  FIELD(shadowsync_receiver_stats_t, last_failed_bucket);
  FIELD(shadowsync_receiver_stats_t, last_failed_tensor);
  FIELD(shadowsync_receiver_stats_t, ready_version);
  FIELD(shadowsync_receiver_stats_t, last_transfer_ns);
  FIELD(shadowsync_receiver_stats_t, last_paced);
  FIELD(shadowsync_receiver_stats_t, last_deadline_limited);
  FIELD(shadowsync_receiver_stats_t, last_pacing_budget);
  FIELD(shadowsync_receiver_stats_t, last_idle_step_ns);
  FIELD(shadowsync_receiver_stats_t, last_step_during_ns);
  FIELD(shadowsync_receiver_stats_t, last_step_ratio);
  FIELD(shadowsync_receiver_stats_t, last_pacing_steps);
  FIELD(shadowsync_receiver_stats_t, last_busy_ns);
  FIELD(shadowsync_receiver_stats_t, last_held_back_ns);
  FIELD(shadowsync_receiver_stats_t, last_duty);
  FIELD(shadowsync_receiver_stats_t, last_swap_ns);
  FIELD(shadowsync_receiver_stats_t, last_swap_started_ns);
  FIELD(shadowsync_receiver_stats_t, gated_swaps);
  FIELD(shadowsync_receiver_stats_t, gates_abandoned);
  FIELD(shadowsync_receiver_stats_t, last_clean_step_wait_ns);
  FIELD(shadowsync_receiver_stats_t, last_clean_step_missed);
  FIELD(shadowsync_receiver_stats_t, plan_pieces);
  FIELD(shadowsync_receiver_stats_t, plan_staging_bytes);
  FIELD(shadowsync_receiver_stats_t, routed_bytes);
  FIELD(shadowsync_receiver_stats_t, trainer_count);
  FIELD(shadowsync_receiver_stats_t, routing_fingerprint);
  FIELD(shadowsync_receiver_stats_t, routed_in_place_bytes);
  end_struct();

  STRUCT(shadowsync_group_swap_t);
  FIELD(shadowsync_group_swap_t, group);
  FIELD(shadowsync_group_swap_t, slot);
  FIELD(shadowsync_group_swap_t, content_version);
  end_struct();

  STRUCT(shadowsync_source_tensor_t);
  FIELD(shadowsync_source_tensor_t, name);
  FIELD(shadowsync_source_tensor_t, data);
  FIELD(shadowsync_source_tensor_t, dtype);
  FIELD(shadowsync_source_tensor_t, shape);
  FIELD(shadowsync_source_tensor_t, ndim);
  end_struct();

  STRUCT(shadowsync_plan_copy_t);
  FIELD(shadowsync_plan_copy_t, wire);
  FIELD(shadowsync_plan_copy_t, engine);
  FIELD(shadowsync_plan_copy_t, ndim);
  FIELD(shadowsync_plan_copy_t, shape);
  FIELD(shadowsync_plan_copy_t, src_offset);
  FIELD(shadowsync_plan_copy_t, src_strides);
  FIELD(shadowsync_plan_copy_t, dst_offset);
  FIELD(shadowsync_plan_copy_t, dst_strides);
  end_struct();

  STRUCT(shadowsync_wire_range_t);
  FIELD(shadowsync_wire_range_t, group);
  FIELD(shadowsync_wire_range_t, reserved);
  FIELD(shadowsync_wire_range_t, begin);
  FIELD(shadowsync_wire_range_t, end);
  end_struct();

  STRUCT(shadowsync_tensor_region_t);
  FIELD(shadowsync_tensor_region_t, tensor);
  FIELD(shadowsync_tensor_region_t, kind);
  FIELD(shadowsync_tensor_region_t, ndim);
  FIELD(shadowsync_tensor_region_t, begin);
  FIELD(shadowsync_tensor_region_t, end);
  FIELD(shadowsync_tensor_region_t, first);
  FIELD(shadowsync_tensor_region_t, count);
  end_struct();

  STRUCT(shadowsync_source_shard_t);
  FIELD(shadowsync_source_shard_t, region);
  FIELD(shadowsync_source_shard_t, data);
  FIELD(shadowsync_source_shard_t, dtype);
  end_struct();

  STRUCT(shadowsync_rank_ranges_t);
  FIELD(shadowsync_rank_ranges_t, rank);
  FIELD(shadowsync_rank_ranges_t, ranges);
  FIELD(shadowsync_rank_ranges_t, count);
  end_struct();

  STRUCT(shadowsync_route_t);
  FIELD(shadowsync_route_t, trainer);
  FIELD(shadowsync_route_t, engine);
  FIELD(shadowsync_route_t, group);
  FIELD(shadowsync_route_t, reserved);
  FIELD(shadowsync_route_t, bucket);
  FIELD(shadowsync_route_t, wire_offset);
  FIELD(shadowsync_route_t, source_offset);
  FIELD(shadowsync_route_t, bytes);
  end_struct();

  STRUCT(shadowsync_routing_plan_info_t);
  FIELD(shadowsync_routing_plan_info_t, size);
  FIELD(shadowsync_routing_plan_info_t, trainer_count);
  FIELD(shadowsync_routing_plan_info_t, engine_count);
  FIELD(shadowsync_routing_plan_info_t, fingerprint);
  FIELD(shadowsync_routing_plan_info_t, route_count);
  end_struct();
}

static void statuses(void) {
  CONSTANT(SHADOWSYNC_SUCCESS);
  CONSTANT(SHADOWSYNC_INVALID_ARGUMENT);
  CONSTANT(SHADOWSYNC_LAYOUT_MISMATCH);
  CONSTANT(SHADOWSYNC_BAD_HEADER);
  CONSTANT(SHADOWSYNC_STALE_VERSION);
  CONSTANT(SHADOWSYNC_TIMEOUT);
  CONSTANT(SHADOWSYNC_TRANSPORT_ERROR);
  CONSTANT(SHADOWSYNC_BACKEND_ERROR);
  CONSTANT(SHADOWSYNC_SHUTDOWN);
  CONSTANT(SHADOWSYNC_SUPERSEDED);
  CONSTANT(SHADOWSYNC_INTERNAL_ERROR);
  CONSTANT(SHADOWSYNC_INVALID_HANDLE);
  CONSTANT(SHADOWSYNC_NOT_SUPPORTED);
  CONSTANT(SHADOWSYNC_IN_PROGRESS);
}

static void constants(void) {
  CONSTANT(SHADOWSYNC_NUM_RESULTS);
  CONSTANT(SHADOWSYNC_C_API_VERSION);
  CONSTANT(SHADOWSYNC_CONFIG_MAGIC);
  CONSTANT(SHADOWSYNC_CONFIG_VERSION);
  CONSTANT(SHADOWSYNC_CONFIG_UNDEF_INT);
  CONSTANT(SHADOWSYNC_CONFIG_UNDEF_INT64);
  CONSTANT(SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION);
  CONSTANT(SHADOWSYNC_MAX_HEADER_GROUPS);
  CONSTANT(SHADOWSYNC_MAX_HEADER_BYTES);
  CONSTANT(SHADOWSYNC_NCCL_UNIQUE_ID_BYTES);
  CONSTANT(SHADOWSYNC_STUCK_ABORT_EXIT_STATUS);
  CONSTANT(SHADOWSYNC_SWAP_REBIND);
  CONSTANT(SHADOWSYNC_SWAP_COPY_IN);
  CONSTANT(SHADOWSYNC_SWAP_REMAP);
  CONSTANT(SHADOWSYNC_COMMIT_AUTO);
  CONSTANT(SHADOWSYNC_COMMIT_COORDINATED);
  CONSTANT(SHADOWSYNC_SAME_HOST_MEMORY_HOST);
  CONSTANT(SHADOWSYNC_SAME_HOST_MEMORY_DEVICE);
  CONSTANT(SHADOWSYNC_REGION_BOX);
  CONSTANT(SHADOWSYNC_REGION_ELEMENTS);
}

int main(void) {
  printf("{\n  \"structs\": {");
  first_item = 1;
  structs();
  printf("\n  },\n  \"statuses\": {");
  first_item = 1;
  statuses();
  printf("\n  },\n  \"constants\": {");
  first_item = 1;
  constants();
  printf("\n  }\n}\n");
  return 0;
}
