"""The cache-operator contract: domain, op names, attribute names, config keys (see
docs/design.md). The compiled library ``ho_onnx._ops`` implements it (``csrc/``)."""

from __future__ import annotations

DOMAIN = "ai.hyperoffload"
OPSET_VERSION = 1

PREFETCH = "Prefetch"
WAIT = "Wait"
STORE = "Store"
DETACH = "Detach"
# Refuses a run whose input dims leave the ranges the plan holds for (``--dim seq=1..2048``);
# reads only its input's shape; its empty output is an ordering input of the cache ops.
GUARD = "Guard"
# A Prefetch whose source is a graph input the caller holds in host memory (the past KV
# cache; on the CUDA EP its input is declared CPU memory, so ORT never copies it whole).
PREFETCH_INPUT = "PrefetchInput"
# A copy of its input into its output, registered for the CPU EP only: on the CUDA EP ORT
# brings the tensor (the present KV cache, a graph output) to host memory at that point.
EMIT = "Emit"
# The rows of an offloaded table (axis 0) its int64 ids select, copied from the host store
# (CPU EP only; an embedding lookup whose table never enters the fast tier). Attributes of
# a weight Prefetch (location, offset, length, shape, name).
GATHER_ROWS = "GatherRows"
# MatMul(x, W) with W, a 2-D offloaded weight, read in place from the host store by ORT's own
# CPU MatMul kernel (CPU EP only: on the CUDA EP ORT moves x to host memory and y back, the
# activations move instead of the weight); input 0 the empty source, input 1 x; attributes
# of a weight Prefetch. An MoE expert computed where its weights live (``--cpu-experts``).
HOST_MATMUL = "HostMatMul"
# Its output is its input (ORT aliases them: no copy), produced after its ordering inputs; an
# opaque value to ORT's optimizers: the nodes of a recomputed activation read their inputs
# through Fences, so ORT neither merges them with the first computation (its common
# subexpression elimination) nor runs them early (schedule/recompute.py).
FENCE = "Fence"
ALL_OPS = (PREFETCH, WAIT, STORE, DETACH, GUARD, PREFETCH_INPUT, EMIT, GATHER_ROWS,
           HOST_MATMUL, FENCE)
# Ops that read an offloaded weight's bytes in place from the host store (no reload).
HOST_READERS = (GATHER_ROWS, HOST_MATMUL)
# Ops registered for the CPU EP only (csrc/registration.cc: add_ops): on the CUDA EP ORT runs
# them on the CPU and copies their inputs and outputs.
CPU_ONLY = (EMIT, GATHER_ROWS, HOST_MATMUL)
# The inputs each op requires first (ordering inputs may follow); every op has its first
# output, Prefetch an optional second ("issued"), Emit one too ("done": an ordering input of
# the next cache op). (csrc/registration.cc: fixed_inputs,
# output_count.)
REQUIRED_INPUTS = {PREFETCH: 1, WAIT: 1, STORE: 1, DETACH: 2, GUARD: 1, PREFETCH_INPUT: 1,
                   EMIT: 1, GATHER_ROWS: 2, HOST_MATMUL: 2, FENCE: 1}
# Ops whose transfers queue on a copy channel (an optional second output, ``issued``).
PREFETCHES = (PREFETCH, PREFETCH_INPUT)
# Attributes of a Guard: per checked dim its axis in the input, its range and its name (the
# names one per line), and the input's name.
ATTR_AXES = "axes"
ATTR_LO = "lo"
ATTR_HI = "hi"
ATTR_DIMS = "dims"
ATTR_INPUT = "input"

# Attributes of a weight Prefetch.
ATTR_LOCATION = "location"
ATTR_OFFSET = "offset"
ATTR_LENGTH = "length"
ATTR_SHAPE = "shape"
ATTR_NAME = "name"
# The data file's size and fingerprint (ho_onnx.graph.fingerprint) when the model was written:
# the library refuses a file that differs. (A ``base_dir`` attribute of older rewriters is
# ignored by the library and no longer written.)
ATTR_DATA_SIZE = "data_size"
ATTR_DATA_FINGERPRINT = "data_fingerprint"
# "disk": read from the data file at every Prefetch (no host-store copy); absent: "host".
ATTR_TIER = "tier"
# 1 on a weight Prefetch and its Wait whose input 1 is a gate: a routed value that is empty
# when no token reaches the reader (an MoE expert no token was routed to); an empty gate
# skips the transfer (only the gate's shape is read).
ATTR_GATED = "gated"
# On a gated weight Prefetch of an expert tensor stacked on axis 0 and read by ORT's MoE/QMoE
# contrib op: the gate is the op's router input and only the experts the op selects move
# (csrc/routing.h): ``route`` is the op's selection rule, ``route_k`` its ``k``.
ATTR_ROUTE = "route"
ATTR_ROUTE_K = "route_k"
ROUTE_SOFTMAX = "softmax"  # MoE: softmax over all E, then the top k (a larger index wins a tie)
ROUTE_TOPK = "topk"  # QMoE: the top k of the raw router row (a larger index wins a tie)
# On a gated Prefetch of a streamed tier (disk): the bytes of the library's expert cache the
# model asks for (the largest asked by an engine's sessions); its loads go through that cache
# (LRU: a hit copies the cached bytes, a miss reads them and keeps them). Absent or 0: none.
ATTR_EXPERT_CACHE = "expert_cache"
# The decode cache (ho_onnx.schedule.decode_cache): streamed weights kept across runs where a
# run's dims leave room. On each Prefetch of a kept weight (with ``expert_cache``, the
# capacity) and on each Guard: the plan's group id (not 0). On a Guard also, per point of
# the plan, the value of each of its dims there (``cache_points``, a row per point) and the
# bytes a run that point covers may keep (``cache_bytes``): the run keeps the most of the
# points that cover the dims of all its Guards, and its Guards limit the cache to that.
ATTR_CACHE_GROUP = "cache_group"
ATTR_CACHE_POINTS = "cache_points"
ATTR_CACHE_BYTES = "cache_bytes"
# On a Guard, per point: the bytes a run that point covers may read ahead (each Prefetch of
# the cache starts the reads of the next ones within it, wrapping around to the next run's
# first). On each Prefetch of the cache: its place among the cache's reads (``cache_order``).
ATTR_CACHE_AHEAD = "cache_ahead"
ATTR_CACHE_ORDER = "cache_order"
# On each Guard of the cache: how many Guards carry it (the run's last sets its limits: only
# it has seen every dim).
ATTR_CACHE_GUARDS = "cache_guards"
# On a cached Prefetch: ``warm`` = 1 makes it a speculation (ho_onnx.schedule.speculate): its
# gate (input 1) is the int64 expert indices the next layer's router picks from an earlier
# hidden state, ``expert`` the weight's expert (its router column); when the indices hold
# it, the weight's read into the expert cache starts. Its output is empty (an ordering input
# of the weight's routed Prefetch); nothing waits for the read. A no-op on the CUDA EP.
ATTR_WARM = "warm"
# Any cache op inside a Loop/Scan body: 1 (it runs once per iteration; its records live for
# one iteration, csrc/run_records.h).
ATTR_ITERATION = "iteration"
ATTR_EXPERT = "expert"
# On every Store: the most bytes of stored activations the plan holds at once (sizes the
# CUDA engine's pinned ring; it grows beyond when concurrent runs need more).
ATTR_HOST_BYTES = "host_bytes"
CONFIG_HOST_BYTES = "ho_onnx.host_bytes"

# Session config entry the runtime helper sets so weights resolve next to the model; a
# model with offloaded weights fails session creation without it.
CONFIG_MODEL_DIR = "ho_onnx.model_dir"
# The most bytes of stored activations the library's host pool holds (default: half the
# physical memory).
CONFIG_HOST_POOL_LIMIT = "ho_onnx.host_pool_limit_bytes"
# "1": every Wait samples ORT's arena statistics into the ``ort_arena_*`` counters (a cost
# per Wait, so off by default: the counters then stay -1).
CONFIG_SAMPLE_ARENA = "ho_onnx.sample_arena"

# Keys of the plan recorded in the optimized model's metadata_props.
META_PREFIX = "ho_onnx."
# "0": planned for ORT sessions without buffer reuse (OffloadOptions.ort_reuse), which
# ho-onnx's Python sessions then set; absent: ORT's default, reuse on.
META_ORT_REUSE = "ort_reuse"
