/* shadowsync's C ABI: double-buffered asynchronous weight updates for inference engines, for C,
 * ctypes (the Python package) and any language with a C FFI. Plain C11; no C++ header is needed.
 *
 * Conventions (those of NCCL):
 *  - Objects are opaque handles. A handle is a token, never a pointer the library dereferences:
 *    a NULL, destroyed or foreign handle, or one of the wrong kind, returns
 *    SHADOWSYNC_INVALID_HANDLE. Destroying an object while another thread is inside a call on it is
 *    safe: the object lives until that call returns.
 *  - Every function returns a shadowsync_status_t. On failure, shadowsync_get_last_error() gives
 *    the detail (which call, which thing, both values) on the calling thread. No function throws or
 *    aborts the process.
 *  - Config structs start with size, magic and version and are initialized with their
 *    SHADOWSYNC_*_CONFIG_INITIALIZER; the library reads min(size, its sizeof) bytes, so a caller
 *    built against an older, smaller struct keeps working. A struct whose magic is wrong (never
 *    initialized) is refused. A NULL config means all defaults. shadowsync_update_header_t is
 *    versioned the same way (size, struct_magic, struct_version;
 *    SHADOWSYNC_UPDATE_HEADER_INITIALIZER), for reading and for writing.
 *  - Each function states its threading contract: "Thread-safe", or "Engine thread only" for the
 *    step hook calls, which must come from one thread (the one that runs the engine's steps).
 *  - Strings returned by the library stay valid as long as the object they came from.
 *
 * The C++ API (receiver.h, sender.h, ...) documents the semantics in full; this header names the
 * C++ counterpart of each call. */
#ifndef SHADOWSYNC_SHADOWSYNC_H_
#define SHADOWSYNC_SHADOWSYNC_H_

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#define SHADOWSYNC_API
#else
#define SHADOWSYNC_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped when a function's signature or a struct's leading fields change meaning. Compare with
 * shadowsync_get_c_api_version() to check that a header and a library agree. */
#define SHADOWSYNC_C_API_VERSION 2

/* ---------------------------------------------------------------------------------------------
 * Status
 * ------------------------------------------------------------------------------------------- */

typedef enum {
  SHADOWSYNC_SUCCESS = 0,
  /* One per shadowsync::ErrorCode, same values. */
  SHADOWSYNC_INVALID_ARGUMENT = 1, /* bad input from the caller; nothing was changed */
  SHADOWSYNC_LAYOUT_MISMATCH = 2,  /* fingerprints or tensor specs disagree */
  SHADOWSYNC_BAD_HEADER = 3,       /* an update header failed validation */
  SHADOWSYNC_STALE_VERSION = 4,    /* a version not greater than the last one */
  SHADOWSYNC_TIMEOUT = 5,          /* a deadline passed */
  SHADOWSYNC_TRANSPORT_ERROR = 6,  /* peer lost, aborted communicator */
  SHADOWSYNC_BACKEND_ERROR = 7,    /* the device backend failed */
  SHADOWSYNC_SHUTDOWN = 8,         /* the object is shutting down */
  SHADOWSYNC_SUPERSEDED = 9,       /* a newer update replaced this one */
  SHADOWSYNC_INTERNAL_ERROR = 10,  /* a bug: please report it */
  /* The C ABI's own. */
  SHADOWSYNC_INVALID_HANDLE = 11,  /* NULL, destroyed, or not a handle of that kind */
  SHADOWSYNC_NOT_SUPPORTED = 12,   /* not in this build (CUDA/NCCL) or not on this backend */
  SHADOWSYNC_IN_PROGRESS = 13,     /* not done yet: poll again (shadowsync_publish_wait) */
  SHADOWSYNC_NUM_RESULTS = 14      /* sentinel */
} shadowsync_status_t;

/* A short description of a status with a hint where to look next. Never NULL; static storage.
 * Thread-safe. */
SHADOWSYNC_API const char* shadowsync_get_error_string(shadowsync_status_t status);

/* The detail of the last failure on the calling thread: "shadowsync_receiver_begin_update:
 * update 3: layout fingerprint ... differs ...". Empty before the first failure; not cleared by
 * successful calls. Valid until the next failing call on this thread. Thread-safe. */
SHADOWSYNC_API const char* shadowsync_get_last_error(void);

/* SHADOWSYNC_C_API_VERSION of the library. Thread-safe. */
SHADOWSYNC_API int shadowsync_get_c_api_version(void);

/* 1 if the library was built with the CUDA backend and the NCCL transport, else 0. Thread-safe. */
SHADOWSYNC_API int shadowsync_has_cuda(void);

/* Canonical name ("bf16", "fp32", ...) and element size of a dtype name or alias ("bfloat16",
 * "torch.bfloat16", "float32", "half", ...). Either output may be NULL. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_dtype_info(const char* dtype, const char** canonical,
                                                         size_t* element_bytes);

/* ---------------------------------------------------------------------------------------------
 * Handles
 * ------------------------------------------------------------------------------------------- */

typedef struct shadowsync_layout* shadowsync_layout_t;
typedef struct shadowsync_backend* shadowsync_backend_t;
typedef struct shadowsync_stream* shadowsync_stream_t;
typedef struct shadowsync_transport* shadowsync_transport_t;
typedef struct shadowsync_loopback* shadowsync_loopback_t;
typedef struct shadowsync_receiver* shadowsync_receiver_t;
typedef struct shadowsync_sender* shadowsync_sender_t;
typedef struct shadowsync_publish* shadowsync_publish_t;
typedef struct shadowsync_remap_arena* shadowsync_remap_arena_t;
typedef struct shadowsync_routing_plan* shadowsync_routing_plan_t;

/* ---------------------------------------------------------------------------------------------
 * Config structs
 * ------------------------------------------------------------------------------------------- */

#define SHADOWSYNC_CONFIG_MAGIC 0x53534346u /* "FCSS" */
#define SHADOWSYNC_CONFIG_VERSION 1u
/* A field left at this value takes the library's default. */
#define SHADOWSYNC_CONFIG_UNDEF_INT INT32_MIN
#define SHADOWSYNC_CONFIG_UNDEF_INT64 INT64_MIN

/* shadowsync::ReceiverConfig. */
typedef struct {
  size_t size;
  uint32_t magic;
  uint32_t version;
  int32_t root_rank;            /* the sender's rank in the transport (default 0) */
  int64_t update_deadline_ms;   /* a whole update must land within this (default 60000) */
  int64_t bucket_deadline_ms;   /* and each bucket within this of the previous (default 10000) */
  int64_t poll_interval_us;     /* progress/error/abort polling while receiving (default 200) */
  /* Appended fields (older callers' smaller structs get their defaults): */
  int32_t swap_strategy;           /* a shadowsync_swap_strategy_t (default SHADOWSYNC_SWAP_REBIND) */
  int32_t engine_uses_cuda_graphs; /* 1: the engine replays CUDA graphs over the weights, and
                                      rebind is refused (default 0) */
  int32_t require_checksums;   /* 1: refuse a header without per-bucket checksums (default 0);
                                  a header that has them is verified either way */
  int32_t reject_nonfinite;    /* 1: refuse an update with a NaN/Inf in an fp32/fp16/bf16 tensor
                                  (default 0) */
  int64_t abort_deadline_ms;   /* an abort of the transport that has not returned after this is
                                  reported: stderr, stuck_aborts in the stats (default 10000) */
  int32_t exit_on_stuck_abort; /* 1: such an abort also ends the process with exit status
                                  SHADOWSYNC_STUCK_ABORT_EXIT_STATUS (default 0) */
  int32_t commit_mode;         /* SHADOWSYNC_COMMIT_AUTO (default: live at the next step) or
                                  SHADOWSYNC_COMMIT_COORDINATED (held ready until
                                  shadowsync_receiver_commit, for tensor-parallel ranks) */
  double decode_slowdown_budget; /* 0 (default): no pacing; else >= 1.0, finite: the mean
                                    engine step while an update streams in stays within this
                                    times the step without one (the receive takes longer) */
  uint64_t max_receive_bytes_per_second; /* a cap on the receive rate; 0 (default): none */
  int32_t gated_swaps;          /* 1 (remap only): the engine calls shadowsync_receiver_after_launch
                                   once each step is enqueued; a swap then remaps there, behind a
                                   gate on the engine stream, while the engine thread goes on
                                   (default 0) */
  int64_t gate_deadline_ms;     /* gated swaps: a gate the engine has not finished this long after
                                   the step before it ended is opened by a watchdog, and the
                                   receiver swaps without gates from then on (default 50) */
  int32_t offer_after_clean_step; /* 1: a complete update is offered once an engine step started
                                     after its last bucket (at most 4 idle steps later), so that
                                     the swap's step is not one a bucket slowed; with checksums
                                     the wait comes before their block, so the sender's publish
                                     returns after that step; implied by a
                                     decode_slowdown_budget (default 0) */
} shadowsync_receiver_config_t;

#define SHADOWSYNC_COMMIT_AUTO 0
#define SHADOWSYNC_COMMIT_COORDINATED 1

/* The exit status of a process ended by exit_on_stuck_abort (EX_SOFTWARE). */
#define SHADOWSYNC_STUCK_ABORT_EXIT_STATUS 70

/* How a swap makes an update visible (shadowsync::SwapStrategy; docs/guides/swap-strategies.md says when to pick
 * which). */
typedef enum {
  SHADOWSYNC_SWAP_REBIND = 0,  /* live pointers flip; not under CUDA graphs */
  SHADOWSYNC_SWAP_COPY_IN = 1, /* one device copy per group into fixed live storage; any backend */
  SHADOWSYNC_SWAP_REMAP = 2    /* the live virtual range is remapped (CUDA VMM); CUDA backend only */
} shadowsync_swap_strategy_t;

#define SHADOWSYNC_RECEIVER_CONFIG_INITIALIZER                                          \
  {                                                                                     \
    sizeof(shadowsync_receiver_config_t), SHADOWSYNC_CONFIG_MAGIC,                      \
        SHADOWSYNC_CONFIG_VERSION, SHADOWSYNC_CONFIG_UNDEF_INT,                         \
        SHADOWSYNC_CONFIG_UNDEF_INT64, SHADOWSYNC_CONFIG_UNDEF_INT64,                   \
        SHADOWSYNC_CONFIG_UNDEF_INT64, SHADOWSYNC_CONFIG_UNDEF_INT,                     \
        SHADOWSYNC_CONFIG_UNDEF_INT, SHADOWSYNC_CONFIG_UNDEF_INT,                       \
        SHADOWSYNC_CONFIG_UNDEF_INT, SHADOWSYNC_CONFIG_UNDEF_INT64,                     \
        SHADOWSYNC_CONFIG_UNDEF_INT, SHADOWSYNC_CONFIG_UNDEF_INT, 0.0, 0,               \
        SHADOWSYNC_CONFIG_UNDEF_INT, SHADOWSYNC_CONFIG_UNDEF_INT64,                     \
        SHADOWSYNC_CONFIG_UNDEF_INT                                                     \
  }

/* shadowsync::SenderConfig. */
typedef struct {
  size_t size;
  uint32_t magic;
  uint32_t version;
  int32_t root_rank;           /* this process's rank in the transport (default 0) */
  int64_t update_deadline_ms;  /* default 60000; a streamed publish's gathering counts too */
  int64_t poll_interval_us;    /* default 200 */
  /* Appended fields (older callers' smaller structs get their defaults): */
  int32_t checksums;           /* 1: send a checksum per bucket, verified by receivers (default 1) */
} shadowsync_sender_config_t;

#define SHADOWSYNC_SENDER_CONFIG_INITIALIZER                                             \
  {                                                                                      \
    sizeof(shadowsync_sender_config_t), SHADOWSYNC_CONFIG_MAGIC, SHADOWSYNC_CONFIG_VERSION, \
        SHADOWSYNC_CONFIG_UNDEF_INT, SHADOWSYNC_CONFIG_UNDEF_INT64,                      \
        SHADOWSYNC_CONFIG_UNDEF_INT64, SHADOWSYNC_CONFIG_UNDEF_INT                       \
  }

/* shadowsync::NcclTransportConfig. */
typedef struct {
  size_t size;
  uint32_t magic;
  uint32_t version;
  int32_t max_ctas;             /* 0 (default): NCCL's default */
  int32_t min_ctas;             /* 0 (default): NCCL's default */
  int32_t cga_cluster_size;     /* 0 (default): NCCL's default */
  int64_t init_timeout_ms;      /* default 300000 */
  int64_t enqueue_timeout_ms;   /* default 120000 */
  int64_t finalize_timeout_ms;  /* default 30000 */
} shadowsync_nccl_config_t;

#define SHADOWSYNC_NCCL_CONFIG_INITIALIZER                                                 \
  {                                                                                        \
    sizeof(shadowsync_nccl_config_t), SHADOWSYNC_CONFIG_MAGIC, SHADOWSYNC_CONFIG_VERSION,  \
        SHADOWSYNC_CONFIG_UNDEF_INT, SHADOWSYNC_CONFIG_UNDEF_INT,                          \
        SHADOWSYNC_CONFIG_UNDEF_INT, SHADOWSYNC_CONFIG_UNDEF_INT64,                        \
        SHADOWSYNC_CONFIG_UNDEF_INT64, SHADOWSYNC_CONFIG_UNDEF_INT64                       \
  }

/* ---------------------------------------------------------------------------------------------
 * Layout (layout.h)
 * ------------------------------------------------------------------------------------------- */

typedef struct {
  const char* name;      /* unique across the layout */
  const char* dtype;     /* a name or alias: "bf16", "torch.bfloat16", "float32", ... */
  const int64_t* shape;  /* ndim dimensions, each positive; NULL when ndim is 0 (a scalar) */
  size_t ndim;
  const char* group;     /* "base" (NULL means "base") or a LoRA adapter's name */
} shadowsync_tensor_spec_t;

typedef struct {
  const char* name;
  size_t tensor_count;
  size_t arena_bytes;
  size_t bucket_bytes;
  size_t bucket_count;
} shadowsync_group_info_t;

typedef struct {
  const char* name;
  const char* dtype;     /* canonical name */
  const int64_t* shape;
  size_t ndim;
  size_t offset;         /* bytes from the group's arena start */
  size_t bytes;
} shadowsync_tensor_info_t;

/* Layout::build. bucket_bytes 0 takes the default (512 MiB); otherwise a positive multiple of
 * 256. Groups are ordered "base" first, then adapters in order of first appearance. The specs are
 * copied. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_create(const shadowsync_tensor_spec_t* specs,
                                                            size_t count, size_t bucket_bytes,
                                                            shadowsync_layout_t* layout);
/* Receivers and senders made from a layout keep their own copy: destroy it whenever. */
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_destroy(shadowsync_layout_t layout);
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_fingerprint(shadowsync_layout_t layout,
                                                                 uint64_t* fingerprint);
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_group_count(shadowsync_layout_t layout,
                                                                 size_t* count);
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_group_info(shadowsync_layout_t layout,
                                                                size_t group,
                                                                shadowsync_group_info_t* info);
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_tensor_info(shadowsync_layout_t layout,
                                                                 size_t group, size_t tensor,
                                                                 shadowsync_tensor_info_t* info);
/* Where a tensor or group is; SHADOWSYNC_INVALID_ARGUMENT naming it when unknown. */
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_find_tensor(shadowsync_layout_t layout,
                                                                 const char* name, size_t* group,
                                                                 size_t* tensor);
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_find_group(shadowsync_layout_t layout,
                                                                const char* name, size_t* group);

/* ---------------------------------------------------------------------------------------------
 * Update headers (update_header.h): what the trainer announces, carried by any control plane
 * ------------------------------------------------------------------------------------------- */

#define SHADOWSYNC_MAX_HEADER_GROUPS 256
/* The largest serialized header: 36 bytes plus 4 per group. */
#define SHADOWSYNC_MAX_HEADER_BYTES (36 + 4 * SHADOWSYNC_MAX_HEADER_GROUPS)

/* The struct version of shadowsync_update_header_t (its struct_version field); bumped when fields
 * are appended. */
#define SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION 1u

/* UpdateHeader (update_header.h). Versioned like the config structs: it starts with size,
 * struct_magic (SHADOWSYNC_CONFIG_MAGIC) and struct_version, set by
 * SHADOWSYNC_UPDATE_HEADER_INITIALIZER, whether the struct is read by the library (begin_update,
 * serialize) or written by it (parse, publish_header). The library reads or writes min(size, its
 * sizeof) bytes and never the caller's size, struct_magic or struct_version; a struct whose
 * struct_magic is wrong (never initialized), whose struct_version is 0, or whose size is smaller
 * than struct version 1 is refused with SHADOWSYNC_INVALID_ARGUMENT. The fields after
 * struct_version are the wire header's. */
typedef struct {
  size_t size;             /* sizeof(shadowsync_update_header_t) as the caller was built */
  uint32_t struct_magic;   /* SHADOWSYNC_CONFIG_MAGIC */
  uint32_t struct_version; /* SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION */
  uint32_t magic;          /* the wire header's magic */
  uint32_t protocol_version;
  uint64_t version;
  uint64_t layout_fingerprint;
  uint32_t group_count;                           /* 1..SHADOWSYNC_MAX_HEADER_GROUPS */
  uint32_t groups[SHADOWSYNC_MAX_HEADER_GROUPS];  /* group indices, strictly increasing */
  uint64_t bucket_count;
} shadowsync_update_header_t;

#define SHADOWSYNC_UPDATE_HEADER_INITIALIZER                                            \
  {                                                                                     \
    sizeof(shadowsync_update_header_t), SHADOWSYNC_CONFIG_MAGIC,                        \
        SHADOWSYNC_UPDATE_HEADER_STRUCT_VERSION, 0, 0, 0, 0, 0, {0}, 0                  \
  }

/* To and from bytes (little-endian, the control channel's field order). serialize writes at most
 * SHADOWSYNC_MAX_HEADER_BYTES; with too small a capacity it returns SHADOWSYNC_INVALID_ARGUMENT
 * and sets *written to the size needed. parse checks the structure (length, count, magic):
 * SHADOWSYNC_BAD_HEADER; the receiver checks the rest. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_header_serialize(
    const shadowsync_update_header_t* header, void* buffer, size_t capacity, size_t* written);
SHADOWSYNC_API shadowsync_status_t shadowsync_header_parse(const void* bytes, size_t size,
                                                           shadowsync_update_header_t* header);

/* ---------------------------------------------------------------------------------------------
 * Backends and streams (host_backend.h, cuda_backend.h)
 * ------------------------------------------------------------------------------------------- */

/* HostBackend: memory is host memory, streams are executor threads. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_host_backend_create(shadowsync_backend_t* backend);
/* CudaBackend of device ordinal `device`. SHADOWSYNC_NOT_SUPPORTED in a build without CUDA;
 * SHADOWSYNC_INVALID_ARGUMENT when there is no such device. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_cuda_backend_create(int device,
                                                                  shadowsync_backend_t* backend);
/* Receivers, senders and streams made from a backend keep it alive: destroy it whenever. */
SHADOWSYNC_API shadowsync_status_t shadowsync_backend_destroy(shadowsync_backend_t backend);
/* "host" or "cuda". */
SHADOWSYNC_API shadowsync_status_t shadowsync_backend_name(shadowsync_backend_t backend,
                                                           const char** name);

/* A stream of the backend (the engine's stream on the host backend). low_priority != 0 asks for
 * the lowest priority. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_stream_create(shadowsync_backend_t backend,
                                                            int low_priority,
                                                            shadowsync_stream_t* stream);
/* Wraps a cudaStream_t (passed as void*; NULL is the legacy default stream) the caller owns and
 * keeps alive, for a CUDA backend: the engine's stream. SHADOWSYNC_NOT_SUPPORTED for a host
 * backend or a build without CUDA. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_stream_wrap_cuda(shadowsync_backend_t backend,
                                                               void* cuda_stream,
                                                               shadowsync_stream_t* stream);
/* Waits for all work enqueued on the stream. */
SHADOWSYNC_API shadowsync_status_t shadowsync_stream_synchronize(shadowsync_stream_t stream);
SHADOWSYNC_API shadowsync_status_t shadowsync_stream_destroy(shadowsync_stream_t stream);

/* ---------------------------------------------------------------------------------------------
 * Transports (loopback_transport.h, nccl_transport.h, same_host_transport.h)
 *
 * A transport handle is taken by the receiver or sender it is given to: when that call succeeds
 * the handle becomes invalid (do not destroy it); when it fails the caller still owns it.
 * ------------------------------------------------------------------------------------------- */

/* In-process ranks (threads) for tests and demos, on host backends. Fault injection into them is
 * a test hook (plugin/c_api/shadowsync_testing.h, not installed; in the test-only
 * libshadowsync_c_testing.so, not in libshadowsync_c.so). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_loopback_create(int world_size,
                                                              shadowsync_loopback_t* loopback);
/* The transport of `rank`; each rank once. */
SHADOWSYNC_API shadowsync_status_t shadowsync_loopback_transport(shadowsync_loopback_t loopback,
                                                                 int rank,
                                                                 shadowsync_transport_t* transport);
/* Transports already made live on. */
SHADOWSYNC_API shadowsync_status_t shadowsync_loopback_destroy(shadowsync_loopback_t loopback);

/* The bytes of a token from shadowsync_make_token, its NUL included. */
#define SHADOWSYNC_TOKEN_BYTES 70
/* A new shared token for the control channel and the same-host transport (shadowsync::make_token
 * in token.h: "ssk1-" and 256 random bits as 64 hex digits), NUL-terminated, into `token` of
 * `size` bytes (at least SHADOWSYNC_TOKEN_BYTES). Tokens that are plainly not random are refused
 * wherever a token is taken. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_make_token(char* token, size_t size);

#define SHADOWSYNC_NCCL_UNIQUE_ID_BYTES 128
/* ncclGetUniqueId, on the side that takes part as a rank. SHADOWSYNC_NOT_SUPPORTED without CUDA.
 * Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_nccl_unique_id(
    uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES]);
/* NcclTransport::create: blocks until all `world_size` ranks joined (config->init_timeout_ms).
 * config may be NULL. SHADOWSYNC_NOT_SUPPORTED without CUDA. */
SHADOWSYNC_API shadowsync_status_t shadowsync_nccl_transport_create(
    const uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES], int rank, int world_size, int device,
    const shadowsync_nccl_config_t* config, shadowsync_transport_t* transport);
/* NcclTransport::create_routed (DESIGN.md section 14): a sharded trainer's routes over NCCL
 * point-to-point, one group of sends and receives per bucket. Communicator rank `rank` of the
 * plan's M trainer ranks and N engine ranks, trainer ranks first (rank < M: trainer rank `rank`;
 * else engine rank rank - M), on CUDA device `device`; every rank calls it with the same `id` and
 * plan, and it blocks until all M + N joined (config->init_timeout_ms). `gpus` holds `gpu_count`
 * = M + N names, one per communicator rank in that order, each unique to its GPU across the hosts
 * (such as the host name and the device's UUID): two ranks on one GPU are refused, naming both
 * (SHADOWSYNC_INVALID_ARGUMENT; NCCL cannot connect them: the same-host pull transport serves a
 * trainer and an engine on one GPU). An engine rank allocates its landing buffer (the plan's
 * largest bucket of routes into it) from `backend`. It moves routes only: give it to a trainer
 * rank's sender with the plan, or to an engine rank's receiver with the plan. The transport keeps
 * `plan` and `backend` alive. config may be NULL. SHADOWSYNC_NOT_SUPPORTED without CUDA. */
SHADOWSYNC_API shadowsync_status_t shadowsync_nccl_routed_transport_create(
    const uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES], int rank, int device,
    shadowsync_routing_plan_t plan, shadowsync_backend_t backend, const char* const* gpus,
    size_t gpu_count, const shadowsync_nccl_config_t* config, shadowsync_transport_t* transport);
/* shadowsync_nccl_routed_transport_create with `replicas` (R >= 1) data-parallel replicas of
 * the engine in the communicator: M + R x N ranks, engine rank e of replica r at communicator
 * rank M + r x N + e, and `gpus` naming all M + R x N in that order. Each trainer rank still
 * sends every route once, to replica 0; each replica's engine rank forwards the bucket it
 * landed to the next replica's (a chain), so no link carries a bucket twice. Every rank passes
 * the same R. The call above is this one with R = 1. */
SHADOWSYNC_API shadowsync_status_t shadowsync_nccl_routed_transport_create_replicated(
    const uint8_t id[SHADOWSYNC_NCCL_UNIQUE_ID_BYTES], int rank, int device,
    shadowsync_routing_plan_t plan, shadowsync_backend_t backend, const char* const* gpus,
    size_t gpu_count, int replicas, const shadowsync_nccl_config_t* config,
    shadowsync_transport_t* transport);
/* The NCCL library the NCCL transport uses (NcclTransport::library(); nccl_transport.h says where
 * it looks; SHADOWSYNC_NCCL_LIBRARY=<path> chooses one). Loads it if no call did yet, and then
 * prints one line on stderr unless SHADOWSYNC_NCCL_QUIET=1. Writes the library's path,
 * NUL-terminated, to `path` unless it is NULL (too small a path_size: SHADOWSYNC_INVALID_ARGUMENT,
 * nothing written, and the last error says how many bytes it needs), and ncclGetVersion's code
 * (22809 for NCCL 2.28.9) to `version` unless it is NULL. SHADOWSYNC_TRANSPORT_ERROR when no usable
 * NCCL is found: the last error lists every place looked at and why each failed.
 * SHADOWSYNC_NOT_SUPPORTED without CUDA. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_nccl_library(char* path, size_t path_size,
                                                           int32_t* version);
/* Directories (':'-separated, e.g. a Python's sys.path) searched for the nvidia-nccl-cu* package's
 * nvidia/nccl/lib/libnccl.so.2 before the library's own guesses, so that the NCCL loaded is the
 * one torch will load. The Python package calls it when it loads the library. Loads nothing.
 * SHADOWSYNC_NOT_SUPPORTED without CUDA. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_nccl_add_python_path(const char* paths);
/* Where the same-host transport's two staging slots live (shadowsync::SameHostMemory). */
typedef enum {
  SHADOWSYNC_SAME_HOST_MEMORY_HOST = 0,  /* a shared memory file; a host backend */
  SHADOWSYNC_SAME_HOST_MEMORY_DEVICE = 1 /* device memory shared through the CUDA driver; a CUDA
                                            backend (CUDA builds) */
} shadowsync_same_host_memory_t;

/* SameHostTransport::serve: the sender's side (rank 0 of 1 + `receivers`) between processes of one
 * host. Listens on the Unix socket `path` (its directory must be the caller's own with mode 0700,
 * and is created so when absent) and blocks until `receivers` receivers connected and proved the
 * token (`token_bytes` bytes at `token`, at least 16: the control channel's token serves), then
 * shares two staging slots of `slot_bytes` each (the sender's bucket size, bucket_bytes of
 * shadowsync_group_info_t) in `memory`: SHADOWSYNC_SAME_HOST_MEMORY_HOST with a host backend,
 * SHADOWSYNC_SAME_HOST_MEMORY_DEVICE with a CUDA backend (SHADOWSYNC_NOT_SUPPORTED without CUDA).
 * connect_timeout_ms 0 takes the default (60000). A receiver with the wrong token is refused and
 * the wait goes on (handshakes run side by side: a peer that connects and says nothing delays no
 * other): SHADOWSYNC_TIMEOUT then names how many came and each peer that stalled or was refused,
 * by pid and uid. Bad arguments, paths and directories: SHADOWSYNC_INVALID_ARGUMENT naming the
 * argument. The transport keeps `backend` alive. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_same_host_transport_serve(
    const char* path, const void* token, size_t token_bytes, int receivers,
    shadowsync_backend_t backend, shadowsync_same_host_memory_t memory, size_t slot_bytes,
    int64_t connect_timeout_ms, shadowsync_transport_t* transport);
/* SameHostTransport::connect: receiver `rank` (1..receivers) connects to the sender at `path`,
 * retrying until one listens (connect_timeout_ms; 0: the default, 60000; then
 * SHADOWSYNC_TIMEOUT), proves the token and checks the sender's proof
 * (SHADOWSYNC_TRANSPORT_ERROR naming which side refused: a wrong token shows here), and maps the
 * sender's staging memory, whose flavour the sender chose. The engine may start first. The
 * transport keeps `backend` alive. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_same_host_transport_connect(
    const char* path, const void* token, size_t token_bytes, int rank,
    shadowsync_backend_t backend, int64_t connect_timeout_ms, shadowsync_transport_t* transport);
/* The same-host pull transport (DESIGN.md section 14): routes of a sharded trainer between
 * processes of one host, each engine rank pulling its routes straight from every trainer rank's
 * exported staging. It moves routes only (a sender per trainer rank, a receiver with a routing
 * plan); broadcasts are refused. SHADOWSYNC_SAME_HOST_MEMORY_HOST: the trainer rank's slots in
 * host memory, with host backends; SHADOWSYNC_SAME_HOST_MEMORY_DEVICE: on the trainer rank's GPU,
 * with cuda backends (each engine rank maps them for its own GPU and pulls with device copies;
 * a build without CUDA: SHADOWSYNC_NOT_SUPPORTED). Engine ranks take the flavour their trainer
 * ranks serve, and refuse one their backend cannot pull (SHADOWSYNC_INVALID_ARGUMENT, naming
 * both). The transport keeps `plan` and `backend` alive; both handles may be destroyed
 * afterwards.
 *
 * Trainer rank `trainer_rank` of `plan`: listens on the Unix socket `path` (its own; directory
 * rules as shadowsync_same_host_transport_serve) and blocks until `engine_processes` engine
 * processes (R x the plan's engine count: one per engine rank of each of R data-parallel engine
 * replicas; R = 1 without replicas) proved the token and said they were set up with the same
 * plan, then shares two staging slots of the plan's max_packed_bytes of the rank. Each bucket is
 * packed into them once, whatever R: every replica's process pulls it from there. An engine set
 * up for another world size or plan, asking for an engine rank and replica taken already, or for
 * a replica outside 0..R-1, is refused and the wait goes on: SHADOWSYNC_TIMEOUT after
 * connect_timeout_ms (0: the default, 60000) names each refusal with both sides' values and the
 * engine ranks missing. `engine_processes` not a multiple of the plan's engine count:
 * SHADOWSYNC_INVALID_ARGUMENT. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_same_host_pull_serve(
    const char* path, const void* token, size_t token_bytes, shadowsync_routing_plan_t plan,
    int32_t trainer_rank, int32_t engine_processes, shadowsync_backend_t backend,
    shadowsync_same_host_memory_t memory, int64_t connect_timeout_ms,
    shadowsync_transport_t* transport);
/* Engine rank `engine_rank` of `plan`: connects to the `count` trainer ranks' paths (`paths[t]`
 * served by trainer rank t; count is the plan's trainer count) within connect_timeout_ms in all
 * (SHADOWSYNC_TIMEOUT: "trainer rank 2 (<path>) never served within 60000 ms"), proves the token
 * and maps each trainer rank's staging. Refused, naming both values: a trainer rank set up for
 * another world size, or an engine rank taken already (SHADOWSYNC_INVALID_ARGUMENT), another
 * routing plan (SHADOWSYNC_LAYOUT_MISMATCH), a path served by another trainer rank than its index
 * (SHADOWSYNC_INVALID_ARGUMENT), a wrong token (SHADOWSYNC_TRANSPORT_ERROR). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_same_host_pull_connect(
    const char* const* paths, size_t count, const void* token, size_t token_bytes,
    shadowsync_routing_plan_t plan, int32_t engine_rank, shadowsync_backend_t backend,
    int64_t connect_timeout_ms, shadowsync_transport_t* transport);
/* shadowsync_same_host_pull_connect for data-parallel replica `replica` (0..R-1, R the
 * replicas the trainer ranks serve) of engine rank `engine_rank`: every replica's process of an
 * engine rank pulls the same routes. A replica the trainer ranks do not serve, or one another
 * process took already: SHADOWSYNC_INVALID_ARGUMENT naming both values. The call above is this
 * one with replica 0. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_same_host_pull_connect_replica(
    const char* const* paths, size_t count, const void* token, size_t token_bytes,
    shadowsync_routing_plan_t plan, int32_t engine_rank, int32_t replica,
    shadowsync_backend_t backend, int64_t connect_timeout_ms, shadowsync_transport_t* transport);
/* Destroys a transport no receiver or sender took. */
SHADOWSYNC_API shadowsync_status_t shadowsync_transport_destroy(shadowsync_transport_t transport);

/* ---------------------------------------------------------------------------------------------
 * Receiver and step hook (receiver.h, step_hook.h): the engine side
 * ------------------------------------------------------------------------------------------- */

typedef struct {
  size_t size;  /* set by the caller: sizeof(shadowsync_receiver_stats_t) */
  uint64_t updates_ready;
  uint64_t updates_failed;
  uint64_t updates_superseded;
  uint64_t bytes_received;
  uint64_t last_accepted_version;
  uint64_t applied_version;
  int32_t needs_transport;  /* no transport now (aborted after a failure, or released): replace it */
  int32_t has_pending;      /* a received update waits for the next step */
  /* Appended fields (a caller's smaller struct is filled up to its size): */
  uint64_t stuck_aborts;        /* transport aborts that overran abort_deadline_ms */
  uint64_t last_failed_version; /* the last update that failed; 0: none failed */
  int32_t last_failure_status;  /* why, as a status: SHADOWSYNC_TIMEOUT (a deadline),
                                   SHADOWSYNC_TRANSPORT_ERROR (peer lost, aborted, or a checksum
                                   mismatch: corrupted in transit), SHADOWSYNC_INVALID_ARGUMENT
                                   (the non-finite guard), SHADOWSYNC_SHUTDOWN; 0 when none */
  int32_t last_failed_group;    /* a check refused it: the group index; else -1 */
  int64_t last_failed_bucket;   /* a checksum mismatch: the bucket within that group; else -1 */
  int64_t last_failed_tensor;   /* the non-finite guard: the tensor index within that group;
                                   else -1 */
  uint64_t ready_version;       /* commit_mode coordinated: the update received and checked,
                                   waiting for shadowsync_receiver_commit; 0: none */
  /* The last update that became ready: its transfer time and what pacing did to it
   * (shadowsync::PacingReport; durations are host wall time). All 0 before the first one. */
  int64_t last_transfer_ns;      /* first receive posted -> completion observed */
  int32_t last_paced;            /* 1: a budget or a rate cap was set; the fields below, to
                                    last_duty, are filled only then */
  int32_t last_deadline_limited; /* 1: a hold was shortened to meet update_deadline_ms */
  double last_pacing_budget;     /* decode_slowdown_budget; 0: none (a rate cap only) */
  int64_t last_idle_step_ns;     /* mean engine step while no update streamed in; 0: not
                                    measured yet (too few steps) */
  int64_t last_step_during_ns;   /* mean step while this update streamed in; 0: none */
  double last_step_ratio;        /* last_step_during_ns / last_idle_step_ns; 0: unknown */
  uint64_t last_pacing_steps;    /* engine steps that started while it streamed in */
  int64_t last_busy_ns;          /* sum over buckets: posted -> completion observed */
  int64_t last_held_back_ns;     /* sum of the holds between buckets */
  double last_duty;              /* busy / (busy + held back) */
  /* The last swap that made an update live (shadowsync::StepHook::last_swap_duration): the
   * engine thread's time in it, swap callback included, and when it started (CLOCK_MONOTONIC,
   * the clock of Python's time.monotonic). Both 0 before the first. */
  int64_t last_swap_ns;
  int64_t last_swap_started_ns;
  /* gated_swaps: gates closed so far, and those a watchdog had to open (then no more gates). */
  uint64_t gated_swaps;
  uint64_t gates_abandoned;
  /* With a budget or offer_after_clean_step, paced or not (filled whatever last_paced says): how
   * long the last ready update was held, complete, for an engine step that started after its
   * last bucket (the step a swap delays is then not the one that bucket slowed; 0: the idle step
   * was not known yet), and 1 when none started within 4 idle steps (an idle engine: offered
   * anyway). */
  int64_t last_clean_step_wait_ns;
  int32_t last_clean_step_missed;
  /* With a receive plan (0 without one): the pieces the receiver thread issues per update (one
   * Backend::memcpy_2d_async each: the plan's copies cut at the wire's buckets), and its staging
   * memory for quantized tensors (allocated with the receiver; 0: it quantizes none). */
  uint64_t plan_pieces;
  uint64_t plan_staging_bytes;
  /* With a routing plan (shadowsync_receiver_use_routing_plan; all 0 without one): the bytes the
   * last ready update's routes carried into this engine rank (the plan's bytes to it), the
   * plan's trainer ranks and its fingerprint. */
  uint64_t routed_bytes;
  int32_t trainer_count;
  uint64_t routing_fingerprint;
  /* Of routed_bytes, those read where the trainer ranks' shards lie (the same-host pull
   * transport with device memory the trainer could share: nothing packed on its side). */
  uint64_t routed_in_place_bytes;
} shadowsync_receiver_stats_t;

#define SHADOWSYNC_RECEIVER_STATS_INITIALIZER                                                  \
  {                                                                                            \
    sizeof(shadowsync_receiver_stats_t), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, \
        0.0, 0, 0, 0.0, 0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0                       \
  }

/* One group made live by a swap. */
typedef struct {
  size_t group;
  int32_t slot;
  uint64_t content_version;
} shadowsync_group_swap_t;

/* Called on the engine thread after a swap, before before_step returns (rebind here). Must not
 * call back into this receiver's step hook. */
typedef void (*shadowsync_swap_callback_t)(void* user_data, uint64_t version,
                                           const shadowsync_group_swap_t* swaps, size_t count);

/* Allocates both slots of every group on the backend and starts the receiver thread. transport
 * may be NULL until the rendezvous is done (shadowsync_receiver_replace_transport). config may be
 * NULL. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_create(
    shadowsync_layout_t layout, shadowsync_backend_t backend, shadowsync_transport_t transport,
    const shadowsync_receiver_config_t* config, shadowsync_receiver_t* receiver);
/* One strided copy of a receive plan (receive_plan.h), in elements: `shape` elements from the
 * wire tensor named `wire` (from element `src_offset`, strides `src_strides`) into the engine
 * tensor named `engine` (`dst_offset`, `dst_strides`). The three arrays have `ndim` entries.
 * With `wire` NULL the entry names an engine tensor the plan keeps (frozen: no copy writes it;
 * each slot gets its live bytes once, before its first receive); the other fields are ignored. */
typedef struct {
  const char* wire;
  const char* engine;
  size_t ndim;
  const int64_t* shape;
  int64_t src_offset;
  const int64_t* src_strides;
  int64_t dst_offset;
  const int64_t* dst_strides;
} shadowsync_plan_copy_t;

/* As shadowsync_receiver_create for an engine whose layout is not the trainer's: the slots have
 * `layout` (the engine's); updates come in `wire_layout` (the trainer's: headers are checked
 * against it) and each received bucket is copied into the shadow by the receive plan built from
 * `copies` (checked first: SHADOWSYNC_ERROR_LAYOUT_MISMATCH or INVALID_ARGUMENT naming the tensors
 * when a copy does not fit or an engine tensor is neither written exactly once nor kept; nothing
 * is allocated then). The copies are read during the call only. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_create_with_plan(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, size_t count, shadowsync_backend_t backend,
    shadowsync_transport_t transport, const shadowsync_receiver_config_t* config,
    shadowsync_receiver_t* receiver);
/* A remap arena an engine makes before it meets a receiver (Backend::create_remappable_arena):
 * a live address range that never moves over two physical slots, each also mapped at an address
 * of its own. The engine moves its weights into the live range (slot 0 at creation, zero-filled)
 * and captures its CUDA graphs over it; a receiver made later with
 * shadowsync_receiver_create_with_arenas swaps by remapping the range, which the graphs see.
 * SHADOWSYNC_NOT_SUPPORTED naming why where the backend cannot remap (the host backend, a device
 * without CUDA VMM); SHADOWSYNC_INVALID_ARGUMENT for 0 bytes. Thread-safe. */
typedef struct {
  void* live;        /* what the engine reads: fixed for the arena's life */
  void* slot[2];     /* each slot's own mapping: its bytes, whatever is live */
  size_t bytes;      /* asked for at creation */
  int live_slot;     /* the slot the live range shows now */
} shadowsync_remap_arena_info_t;
SHADOWSYNC_API shadowsync_status_t shadowsync_remap_arena_create(shadowsync_backend_t backend,
                                                                 size_t bytes,
                                                                 shadowsync_remap_arena_t* arena);
SHADOWSYNC_API shadowsync_status_t shadowsync_remap_arena_info(
    shadowsync_remap_arena_t arena, shadowsync_remap_arena_info_t* info);
/* Releases the handle; the memory lives on while a receiver holds the arena. The engine must not
 * read the live range once both are gone. */
SHADOWSYNC_API shadowsync_status_t shadowsync_remap_arena_destroy(shadowsync_remap_arena_t arena);
/* As shadowsync_receiver_create(_with_plan) (`wire_layout` NULL: no plan, `copies` ignored), with
 * `arenas[g]` (NULL entries allowed; `count` at most the layout's groups) as the live memory of
 * group g: swap_strategy must be remap (a swap remaps the arena's live range) or rebind (its two
 * slot mappings are the slots and a swap flips between them: an engine with one set of CUDA graphs
 * per slot; the arena's live slot does not follow those swaps, so before a later receiver takes the
 * arena the engine must read the slot the arena shows), each arena holds exactly its group's arena
 * bytes, laid out
 * as the group, lies on `backend`'s device, and serves no other live receiver (each is refused, naming
 * the group and both values, before anything is allocated). The receiver shares the arenas; the
 * handles stay the caller's. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_create_with_arenas(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, size_t copy_count,
    const shadowsync_remap_arena_t* arenas, size_t count, shadowsync_backend_t backend,
    shadowsync_transport_t transport, const shadowsync_receiver_config_t* config,
    shadowsync_receiver_t* receiver);
/* An engine tensor that holds the FP8 quantization of what the plan's copies into it write, as
 * vLLM's quantization="fp8" computes it after loading (receive_plan.h, PlanQuantization): `engine`
 * (fp8_e4m3) in `parts` equal consecutive parts, their float32 scales in `scale` (`parts`
 * elements, same group). The copies into `engine` land in the receiver's staging memory in their
 * wire dtype (fp32, fp16 or bf16); right after the bucket with the last of them the receiver
 * quantizes them into the shadow, before the update is offered. */
typedef struct {
  const char* engine;
  const char* scale;
  int64_t parts;
} shadowsync_plan_quantization_t;
/* As shadowsync_receiver_create_with_arenas (`arenas` may be NULL with `count` 0) with
 * `quantized_count` quantized tensors in the plan (`wire_layout` must not be NULL). Refused, naming
 * the tensor and both values, as receive_plan.h says, before anything is allocated. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_create_with_quantized_plan(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, size_t copy_count,
    const shadowsync_plan_quantization_t* quantized, size_t quantized_count,
    const shadowsync_remap_arena_t* arenas, size_t count, shadowsync_backend_t backend,
    shadowsync_transport_t transport, const shadowsync_receiver_config_t* config,
    shadowsync_receiver_t* receiver);
/* commit_mode coordinated: makes the ready update `version` live now on `stream` (the engine's;
 * the next step runs on it); call it between two steps on every rank with the same version.
 * SHADOWSYNC_INVALID_ARGUMENT in auto mode or when `version` is not the ready one (the message
 * names the ready and applied versions); nothing changes then. `applied_version` may be NULL.
 * Engine thread. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_commit(shadowsync_receiver_t receiver,
                                                              shadowsync_stream_t stream,
                                                              uint64_t version,
                                                              uint64_t* applied_version);
/* Stops the thread (aborting an update in flight) and frees both slots: the engine must be done
 * with the live pointers. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_destroy(shadowsync_receiver_t receiver);

/* Validates the header against the layout and the last accepted version, queues it and returns
 * at once; the receive runs on the receiver's own thread. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_begin_update(
    shadowsync_receiver_t receiver, const shadowsync_update_header_t* header);
/* The same from serialized header bytes. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_begin_update_bytes(
    shadowsync_receiver_t receiver, const void* bytes, size_t size);
/* Flags of shadowsync_receiver_begin_update_checked. VERIFY_MATCHES_LIVE: the self-check (the
 * update must reproduce the live weights byte for byte: UpdateChecks in receiver.h). */
#define SHADOWSYNC_CHECK_VERIFY_MATCHES_LIVE 1u
/* shadowsync_receiver_begin_update_bytes with checks of this update (SHADOWSYNC_CHECK_* flags;
 * an unknown flag is refused). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_begin_update_checked(
    shadowsync_receiver_t receiver, const void* bytes, size_t size, uint32_t flags);
/* Aborts the update in flight, if any (the transport with it). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_abort_update(shadowsync_receiver_t receiver);
/* Installs a transport (after a failure aborted the old one, or the first). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_replace_transport(
    shadowsync_receiver_t receiver, shadowsync_transport_t transport);
/* Blocks until every queued command was processed. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_drain(shadowsync_receiver_t receiver);

/* The step hook, before each engine step. *applied_version (may be NULL) is the version it made
 * live, or 0 when nothing was pending. `stream` is the stream the engine's steps run on, of the
 * receiver's backend. With nothing pending: a handle lookup and one atomic load. Engine thread
 * only. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_before_step(shadowsync_receiver_t receiver,
                                                                   shadowsync_stream_t stream,
                                                                   uint64_t* applied_version);
/* gated_swaps: after each step's work is enqueued on `stream` and before the engine waits for it.
 * With a gate closed by before_step: waits for the step before it, remaps, opens it;
 * *applied_version (may be NULL) is the version the step just enqueued runs on, 0 when nothing
 * was made live (no gate, or a watchdog opened it first). Engine thread only. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_after_launch(shadowsync_receiver_t receiver,
                                                                    shadowsync_stream_t stream,
                                                                    uint64_t* applied_version);
/* Applies a pending update now, if any (an idle engine). Engine thread only. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_apply_pending_now(
    shadowsync_receiver_t receiver, shadowsync_stream_t stream, uint64_t* applied_version);
/* Applies updates as they arrive until `version` is live: SHADOWSYNC_SUCCESS, or
 * SHADOWSYNC_TIMEOUT once timeout_ms passed (negative: no limit). Engine thread only. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_wait_applied(shadowsync_receiver_t receiver,
                                                                    uint64_t version,
                                                                    int64_t timeout_ms,
                                                                    shadowsync_stream_t stream);
/* Last version made live (0 before the first). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_applied_version(
    shadowsync_receiver_t receiver, uint64_t* version);
/* commit_mode coordinated: the update held ready for commit (0: none); the same as the statistics'
 * ready_version, but one atomic load without a lock, for a step hook. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_ready_version(
    shadowsync_receiver_t receiver, uint64_t* version);
/* commit_mode coordinated: drops update `version` without making it live, now if it is the one
 * held ready (then `*was_ready` is 1), else when its receive completes (a newer update's header
 * cancels that; `*was_ready` 0). For tensor-parallel ranks, each between the same two steps, when
 * an update is ready on some of them only: the next update then lands on every rank alike.
 * SHADOWSYNC_INVALID_ARGUMENT in auto mode. `was_ready` may be NULL. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_discard(shadowsync_receiver_t receiver,
                                                               uint64_t version, int* was_ready);

/* The live pointer table: device memory of the backend, valid until the next swap. Engine thread
 * only. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_live_tensor(shadowsync_receiver_t receiver,
                                                                   size_t group, size_t tensor,
                                                                   void** data);
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_live_tensor_by_name(
    shadowsync_receiver_t receiver, const char* name, void** data);
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_live_arena(shadowsync_receiver_t receiver,
                                                                  size_t group, void** data);
/* copy_in (or remap, for a group without an engine arena), before the first update: the live
 * storage of `group` becomes the engine's own tensors (tensors[t]: tensor t of the group in layout
 * order), for engines whose CUDA graphs were captured over their own parameters; a swap copies
 * the shadow into them (one batched copy). The group's live arena is freed (live_arena gives
 * NULL); rollback is refused from then on. Engine thread. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_use_engine_storage(
    shadowsync_receiver_t receiver, size_t group, void* const* tensors, size_t count);
/* Version of the update whose bytes the group's live slot holds (0: never updated). Engine
 * thread only. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_live_content_version(
    shadowsync_receiver_t receiver, size_t group, uint64_t* version);

/* StepHook::rollback: undoes the last swap in one swap (each group it flipped reads its previous
 * slot again, which holds the bytes it had) and runs the swap callback with the slots live again;
 * *undone_version (may be NULL) is the version undone. The applied version stays; live content
 * versions go back. One level, and only until the next update starts receiving:
 * SHADOWSYNC_INVALID_ARGUMENT when nothing was applied or the last swap was already undone (or the
 * swap strategy is copy_in), SHADOWSYNC_SUPERSEDED naming the update that started writing the
 * previous slots; nothing changes then. Engine thread only. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_rollback(shadowsync_receiver_t receiver,
                                                                shadowsync_stream_t stream,
                                                                uint64_t* undone_version);

/* Set before the first update; NULL removes it. Not thread-safe with before_step. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_set_swap_callback(
    shadowsync_receiver_t receiver, shadowsync_swap_callback_t callback, void* user_data);

/* Counters; stats->size must be set (SHADOWSYNC_RECEIVER_STATS_INITIALIZER). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_stats(shadowsync_receiver_t receiver,
                                                             shadowsync_receiver_stats_t* stats);
/* The last failed update's error text, NUL-terminated and truncated to `capacity` bytes;
 * *length (may be NULL) is its full length. Empty when no update failed. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_last_update_error(
    shadowsync_receiver_t receiver, char* buffer, size_t capacity, size_t* length);

/* ---------------------------------------------------------------------------------------------
 * Sender (sender.h): the trainer side
 * ------------------------------------------------------------------------------------------- */

/* One tensor as the trainer holds it: memory of the sender's backend, contiguous. */
typedef struct {
  const char* name;
  const void* data;
  const char* dtype;     /* a name or alias, as in shadowsync_tensor_spec_t */
  const int64_t* shape;
  size_t ndim;
} shadowsync_source_tensor_t;

/* The sender must be the broadcast root (config->root_rank, default 0). config may be NULL.
 * Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_create(shadowsync_layout_t layout,
                                                            shadowsync_backend_t backend,
                                                            shadowsync_transport_t transport,
                                                            const shadowsync_sender_config_t* config,
                                                            shadowsync_sender_t* sender);
/* Waits for the updates already published (each bounded by its deadline), then stops. */
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_destroy(shadowsync_sender_t sender);
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_replace_transport(
    shadowsync_sender_t sender, shadowsync_transport_t transport);

/* Publishes `groups` at `version` from the trainer's tensors and returns at once. Every tensor of
 * those groups must be given with its spec's dtype and shape; everything is checked before a byte
 * moves. The tensors must stay valid and unchanged until the update is done, whether or not the
 * publish handle is destroyed earlier. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_publish(
    shadowsync_sender_t sender, uint64_t version, const char* const* groups, size_t group_count,
    const shadowsync_source_tensor_t* tensors, size_t tensor_count, shadowsync_publish_t* publish);
/* Starts a publish whose tensors come later through shadowsync_publish_supply, in layout order
 * (ZeRO-3: gather each bucket's parameters just in time). The header is ready at once.
 * Destroying the publish before every tensor was supplied fails the update. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_publish_streamed(
    shadowsync_sender_t sender, uint64_t version, const char* const* groups, size_t group_count,
    shadowsync_publish_t* publish);
/* Streamed publishes: the next `count` tensors in layout order (see
 * shadowsync_publish_next_tensor). Blocks until their bytes were copied out; then the caller may
 * free them. One thread at a time. */
SHADOWSYNC_API shadowsync_status_t shadowsync_publish_supply(shadowsync_publish_t publish,
                                                             const shadowsync_source_tensor_t* tensors,
                                                             size_t count);
/* Streamed publishes: where the next tensor to supply is. *remaining is how many are left
 * (group and tensor are unset when it is 0). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_publish_next_tensor(shadowsync_publish_t publish,
                                                                  size_t* group, size_t* tensor,
                                                                  size_t* remaining);

/* The header to give every receiver (begin_update). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_publish_header(shadowsync_publish_t publish,
                                                             shadowsync_update_header_t* header);
SHADOWSYNC_API shadowsync_status_t shadowsync_publish_header_bytes(shadowsync_publish_t publish,
                                                                   void* buffer, size_t capacity,
                                                                   size_t* written);
/* Waits up to timeout_ms (0: poll; negative: no limit). SHADOWSYNC_SUCCESS when sent,
 * SHADOWSYNC_IN_PROGRESS while still running, or the status of the update's failure. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_publish_wait(shadowsync_publish_t publish,
                                                           int64_t timeout_ms);
/* *done = 1 once finished, successfully or not. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_publish_done(shadowsync_publish_t publish, int* done);
/* Releases the handle; a publish keeps running (a streamed one still missing tensors fails). */
SHADOWSYNC_API shadowsync_status_t shadowsync_publish_destroy(shadowsync_publish_t publish);

/* ---------------------------------------------------------------------------------------------
 * Routing plans (core/routing_plan.h): sharded trainers, every byte moved once from the trainer
 * rank that holds it to each engine rank that needs it (DESIGN.md section 14). Built at set-up on
 * both sides from the same inputs; the fingerprints must agree. A routed sender per trainer rank
 * and shadowsync_receiver_use_routing_plan move updates by it.
 *
 * Output arrays take a capacity and a count: *count is set to the entries there are; when the
 * capacity is smaller the call returns SHADOWSYNC_INVALID_ARGUMENT and writes none (call with
 * capacity 0 to learn the count).
 * ------------------------------------------------------------------------------------------- */

/* Bytes [begin, end) of the wire arena of group `group` (an index of the wire layout's groups).
 * `reserved` must be 0. */
typedef struct {
  uint32_t group;
  uint32_t reserved;
  uint64_t begin;
  uint64_t end;
} shadowsync_wire_range_t;

/* Kinds of shadowsync_tensor_region_t. */
#define SHADOWSYNC_REGION_BOX 0      /* begin[d] <= index[d] < end[d] in each of ndim dimensions */
#define SHADOWSYNC_REGION_ELEMENTS 1 /* elements [first, first + count) of the row-major tensor */

/* What a trainer rank holds of wire tensor `tensor`: a box (an FSDP2 Shard(d) slice, a Megatron
 * column- or row-parallel slice; `ndim` entries in `begin` and `end`, `first`/`count` ignored) or
 * a flat element range (a ZeRO-3 partition of the flattened parameter; `ndim`, `begin`, `end`
 * ignored). */
typedef struct {
  const char* tensor;
  int32_t kind; /* SHADOWSYNC_REGION_BOX or SHADOWSYNC_REGION_ELEMENTS */
  size_t ndim;
  const int64_t* begin;
  const int64_t* end;
  int64_t first;
  int64_t count;
} shadowsync_tensor_region_t;

/* What rank `rank` holds (a trainer rank) or needs (an engine rank): `count` wire ranges of any
 * groups, in any order (they are sorted and merged). */
typedef struct {
  int32_t rank;
  const shadowsync_wire_range_t* ranges;
  size_t count;
} shadowsync_rank_ranges_t;

/* One route (core/routing_plan.h, Route): `bytes` bytes of bucket `bucket` of group `group`, at
 * `wire_offset` of the group's wire arena, from trainer rank `trainer` (at `source_offset` of
 * what it holds of the group, packed in wire order) to engine rank `engine`. */
typedef struct {
  int32_t trainer;
  int32_t engine;
  uint32_t group;
  uint32_t reserved;
  uint64_t bucket;
  uint64_t wire_offset;
  uint64_t source_offset;
  uint64_t bytes;
} shadowsync_route_t;

/* shadowsync_routing_plan_info: the caller sets `size` (SHADOWSYNC_ROUTING_PLAN_INFO_INITIALIZER);
 * the library fills min(size, its sizeof) bytes, so fields appended later stay unread by older
 * callers. */
typedef struct {
  size_t size;
  int32_t trainer_count;
  int32_t engine_count;
  uint64_t fingerprint;  /* of the wire layout and every route: compare across ranks */
  uint64_t route_count;  /* over every group and bucket */
} shadowsync_routing_plan_info_t;

#define SHADOWSYNC_ROUTING_PLAN_INFO_INITIALIZER \
  { sizeof(shadowsync_routing_plan_info_t), 0, 0, 0, 0 }

/* The wire ranges of `region` of a tensor of `layout` (regions_of_box, regions_of_elements),
 * sorted and merged: a box of whole rows is one range, a box of part rows one range per row.
 * SHADOWSYNC_INVALID_ARGUMENT naming the tensor and the box or elements when they are empty or
 * outside its shape, or the kind is unknown; SHADOWSYNC_LAYOUT_MISMATCH for a tensor the layout
 * does not have. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_layout_region_ranges(
    shadowsync_layout_t layout, const shadowsync_tensor_region_t* region,
    shadowsync_wire_range_t* ranges, size_t capacity, size_t* count);
/* The wire ranges `receiver` reads of each update: with a receive plan what its pieces read
 * (needed_by), in the plan's wire layout; without one every tensor of its layout (which is then
 * the wire layout). An engine rank's needs for shadowsync_routing_plan_create. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_needed_ranges(
    shadowsync_receiver_t receiver, shadowsync_wire_range_t* ranges, size_t capacity,
    size_t* count);
/* The wire ranges a receiver of `layout` would read of each update, without making one (no slots
 * allocated): with `wire_layout` the pieces of the receive plan of `copies` and `quantized`
 * (needed_by), built and refused as shadowsync_receiver_create_with_quantized_plan builds it;
 * `wire_layout` NULL: every tensor of `layout` (`copies` and `quantized` ignored). What
 * shadowsync_receiver_needed_ranges of that receiver returns: an engine rank's needs for
 * shadowsync_routing_plan_create, asked before any receiver exists. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receive_plan_needed_ranges(
    shadowsync_layout_t layout, shadowsync_layout_t wire_layout,
    const shadowsync_plan_copy_t* copies, size_t copy_count,
    const shadowsync_plan_quantization_t* quantized, size_t quantized_count,
    shadowsync_wire_range_t* ranges, size_t capacity, size_t* count);
/* RoutingPlan::build over `wire_layout`: `trainers[i]` what trainer rank trainers[i].rank holds,
 * `engines[j]` what engine rank engines[j].rank needs; ranks 0..M-1 and 0..N-1 each once, in any
 * order. `engines` NULL with `engine_count` 0: one engine rank needing every tensor. Refused with
 * SHADOWSYNC_INVALID_ARGUMENT, the last error naming the ranks and the bytes (tensor and group):
 * a rank missing, outside or given twice, a range of a group the layout does not have or outside
 * its arena, bytes two trainer ranks both hold (a replicated tensor is sent by one: leave it out
 * of the others' ranges), bytes an engine rank needs that no trainer rank holds. The plan keeps
 * its own copy of everything. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_routing_plan_create(
    shadowsync_layout_t wire_layout, const shadowsync_rank_ranges_t* trainers,
    size_t trainer_count, const shadowsync_rank_ranges_t* engines, size_t engine_count,
    shadowsync_routing_plan_t* plan);
SHADOWSYNC_API shadowsync_status_t shadowsync_routing_plan_destroy(shadowsync_routing_plan_t plan);
/* Counts and fingerprint; info->size must be set. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_routing_plan_info(
    shadowsync_routing_plan_t plan, shadowsync_routing_plan_info_t* info);
/* Bytes engine rank `engine` receives per update, and trainer rank `trainer` sends, over every
 * group. SHADOWSYNC_INVALID_ARGUMENT for a rank outside the plan. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_routing_plan_bytes_to_engine(
    shadowsync_routing_plan_t plan, int32_t engine, uint64_t* bytes);
SHADOWSYNC_API shadowsync_status_t shadowsync_routing_plan_bytes_from_trainer(
    shadowsync_routing_plan_t plan, int32_t trainer, uint64_t* bytes);
/* The slice [*begin, *end) of trainer rank `trainer`'s packing of group `group` (what it holds,
 * in wire order) that the routes of bucket `bucket` from it read: what it stages for that bucket
 * (empty, 0 and 0, when none comes from it). Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_routing_plan_packed_range(
    shadowsync_routing_plan_t plan, int32_t trainer, size_t group, size_t bucket, uint64_t* begin,
    uint64_t* end);
/* The largest packed range of trainer rank `trainer` over every bucket: its staging for one
 * bucket at a time. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_routing_plan_max_packed_bytes(
    shadowsync_routing_plan_t plan, int32_t trainer, uint64_t* bytes);
/* The routes of bucket `bucket` of group `group`, by trainer rank, then engine rank, then wire
 * offset. SHADOWSYNC_INVALID_ARGUMENT for a group or bucket out of range. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_routing_plan_routes(shadowsync_routing_plan_t plan,
                                                                  size_t group, size_t bucket,
                                                                  shadowsync_route_t* routes,
                                                                  size_t capacity, size_t* count);

/* One trainer rank's shard of a wire tensor (shadowsync::SourceShard): `region` of tensor
 * region.tensor, at `data` (memory of the sender's backend, contiguous in the row-major order of
 * the region: the local tensor of an FSDP2 parameter, a Megatron slice, a ZeRO-3 partition
 * without its padding). */
typedef struct {
  shadowsync_tensor_region_t region;
  const void* data;
  const char* dtype; /* a name or alias, as in shadowsync_tensor_spec_t */
} shadowsync_source_shard_t;

/* A sender for trainer rank `trainer_rank` of `plan` (built on `layout`): it publishes only its
 * shards (shadowsync_sender_publish_shards) through `transport`, which must move routes of the
 * plan for that rank. Routed updates carry no checksums yet: config->checksums defaults to 0
 * here, and 1 is refused. Refused, naming both values: a rank outside the plan, a transport that
 * moves no routes or is another rank's (SHADOWSYNC_INVALID_ARGUMENT), a plan of another layout
 * (SHADOWSYNC_LAYOUT_MISMATCH). The plan may be destroyed afterwards. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_create_for_trainer_rank(
    shadowsync_layout_t layout, shadowsync_routing_plan_t plan, int32_t trainer_rank,
    shadowsync_backend_t backend, shadowsync_transport_t transport,
    const shadowsync_sender_config_t* config, shadowsync_sender_t* sender);
/* A routed sender: publishes `groups` at `version` from this trainer rank's shards. Every tensor
 * the plan has it hold must be given, with its spec's dtype and the region the plan was built
 * with; shards of tensors it holds nothing of are ignored. Checked before a byte moves
 * (SHADOWSYNC_INVALID_ARGUMENT naming the tensor, the rank and both values). The shards must
 * stay valid and unchanged until the update is done. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_publish_shards(
    shadowsync_sender_t sender, uint64_t version, const char* const* groups, size_t group_count,
    const shadowsync_source_shard_t* shards, size_t shard_count, shadowsync_publish_t* publish);
/* The staging memory the sender packs into: two buckets, or for a routed sender two slots of
 * the plan's max_packed_bytes of its rank. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_staging_bytes(shadowsync_sender_t sender,
                                                                   uint64_t* bytes);
/* A routed sender's last update: *in_place is 1 when the engines read its routes where the
 * shards lie (nothing packed on this rank), 0 when they were packed into the staging, and -1
 * before the first routed update. When 0, `buffer` gets why (NUL-terminated, truncated to
 * `capacity` bytes; *length, which may be NULL, is its full length); else it is emptied.
 * Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_sender_routes_in_place(shadowsync_sender_t sender,
                                                                     int32_t* in_place,
                                                                     char* buffer, size_t capacity,
                                                                     size_t* length);
/* Makes `receiver` engine rank `engine_rank` of `plan` (built on its wire layout): its updates
 * are then every trainer rank's routes into it, moved by its transport (which must move routes of
 * the plan for that rank, or the update fails, named). Before the first update only. Refused:
 * a rank outside the plan, an update already accepted, require_checksums set
 * (SHADOWSYNC_INVALID_ARGUMENT), a plan of another wire layout (SHADOWSYNC_LAYOUT_MISMATCH). The
 * plan may be destroyed afterwards. Thread-safe. */
SHADOWSYNC_API shadowsync_status_t shadowsync_receiver_use_routing_plan(
    shadowsync_receiver_t receiver, shadowsync_routing_plan_t plan, int32_t engine_rank);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* SHADOWSYNC_SHADOWSYNC_H_ */
