"""Run a rewritten model: ONNX Runtime sessions with the ho-onnx custom-op library loaded.

The ORT custom-op library ``libho_onnx_ops.so`` (no Python in it; C/C++ hosts load the same
file) implements the cache operators of domain ``ai.hyperoffload`` (see docs/design.md). The
Python module ``ho_onnx._ops`` (counters, build facts, measurement switches) links to it and is
imported before ORT loads it, so both see the same process-wide state.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import onnxruntime as ort

from ... import contract
from ...contract import (
    CONFIG_HOST_BYTES,
    CONFIG_HOST_POOL_LIMIT,
    CONFIG_MODEL_DIR,
    CONFIG_SAMPLE_ARENA,
)
from ...errors import ModelLoadError

_ORDERS = {
    "priority": ort.ExecutionOrder.PRIORITY_BASED,
    "default": ort.ExecutionOrder.DEFAULT,
}


def _ops() -> Any:
    from ... import _ops

    return _ops


LIBRARY_NAME = "libho_onnx_ops.so"


def library_path() -> str:
    """Path of the ORT custom-op library ``libho_onnx_ops.so`` (loaded into this process first).

    The file is Python-free: C, C++, C# or Java hosts register it with
    ``RegisterCustomOpsLibrary`` (README: "C and C++ hosts").
    """
    return os.path.join(os.path.dirname(os.path.abspath(_ops().__file__)), LIBRARY_NAME)


def include_dir() -> str:
    """Folder with ``ho_onnx_c_api.h`` and the ``onnxruntime/onnxruntime_c_api.h`` the
    library was compiled against, for C/C++ hosts."""
    return os.path.join(os.path.dirname(library_path()), "include")


def session_options(
    model_path: str | os.PathLike[str] | None = None,
    base: ort.SessionOptions | None = None,
    execution_order: str = "priority",
    *,
    model_dir: str | os.PathLike[str] | None = None,
    memory_patterns: bool = False,
    cpu_arena: str = "auto",
    buffer_reuse: bool | None = None,
) -> ort.SessionOptions:
    """Session options that load the ho-onnx ops.

    ``base`` is copied (never modified). ``execution_order`` is ``"priority"`` (ORT's
    PRIORITY_BASED order, which follows the rewritten file's node order and so overlaps
    transfers with compute) or ``"default"`` (leave ORT's order alone). ``model_dir`` (else
    ``model_path``'s folder) is the directory offloaded weights' files are resolved in
    (``ho_onnx.model_dir``: required for a model with offloaded weights).
    ``memory_patterns`` sets ``enable_mem_pattern`` (``base``'s value is not used): off by
    default, because with them ORT, from the third run on, packs a run's activations into a
    block allocated beside the arena's chunks, which the planner's budget does not count
    (measured on an H100: +0.55 GiB of device memory for a 24-layer decoder at 2,048 tokens,
    latency within 3 %; docs/benchmarks.md).
    ``cpu_arena``: ``"as_requested"`` gives the session ORT's CPU arena grown by what is
    requested (one arena of the process, registered once: :func:`cpu_arena_shared`), not by
    powers of two, which reserved twice its peak on a disk-tier plan (257 MiB for 129 in
    use); ``"ort"`` leaves ORT's own per-session arena; ``"auto"`` (default) is
    :func:`arena_for` of ``model_path`` (``"ort"`` without one), the arena a plan counts
    (``target/ort/arena.py``): another can hold more than its budget (stop 53: a plan of
    the 2.75 GB decoder at 15 % completed under its hard limit with ``"auto"`` and was
    OOM-killed with ``"as_requested"``, which grows a region for each request no freed
    chunk of its own size fits). A ``base`` that sets ``session.use_env_allocators`` itself
    is left as it is. ``buffer_reuse`` False turns ORT's buffer reuse off
    (``enable_mem_reuse``); None, where ``model_path``'s plan counted none
    (:func:`ort_reuse_of`); True leaves ``base``'s.
    """
    _check_choices(cpu_arena, execution_order)
    if cpu_arena == "auto":
        cpu_arena = arena_for(model_path)
    if model_dir is None and model_path is not None:
        model_dir = os.path.dirname(os.path.abspath(os.fspath(model_path)))
    so = ort.SessionOptions()
    if base is not None:
        _copy_options(base, so, skip=(CONFIG_MODEL_DIR,) if model_dir is not None else ())
    if execution_order == "priority":
        so.execution_order = _ORDERS["priority"]
    elif base is None:
        so.execution_order = _ORDERS["default"]
    so.enable_mem_pattern = memory_patterns
    if not (ort_reuse_of(model_path) if buffer_reuse is None else buffer_reuse):
        so.enable_mem_reuse = False
    if cpu_arena == "as_requested" and not _config(so, _USE_ENV_ALLOCATORS) \
            and cpu_arena_shared():
        so.add_session_config_entry(_USE_ENV_ALLOCATORS, "1")
    if model_dir is not None:
        so.add_session_config_entry(CONFIG_MODEL_DIR, os.path.abspath(os.fspath(model_dir)))
    # The config entry must be set before registering: the library reads it then.
    so.register_custom_ops_library(library_path())
    return so


def _check_choices(cpu_arena: str, execution_order: str) -> None:
    if cpu_arena not in ARENAS:
        raise ValueError(f"cpu_arena must be one of {', '.join(map(repr, ARENAS))}, got "
                         f"{cpu_arena!r}")
    if execution_order not in _ORDERS:
        raise ValueError(f"execution_order must be one of {sorted(_ORDERS)}, got "
                         f"{execution_order!r}")


_USE_ENV_ALLOCATORS = "session.use_env_allocators"
ARENAS = ("auto", "as_requested", "ort")


def arena_for(model: str | os.PathLike[str] | bytes | None) -> str:
    """``"as_requested"`` for a model whose every graph input has a fixed shape (every run
    asks the arena for the same sizes), else ``"ort"``. An arena grown by what is requested
    keeps every region it grew: where a run asks for more than the last (a decode step's KV
    cache, one position longer) it grows again, and without a shrink at the end of each run
    it held 10.3 GB after 255 decode steps of an 8-layer decoder at 2k context (its KV cache
    offloaded) run as Optimum runs it (its presents returned, fed back as the past), 40 MiB
    more every step (ORT's own arena: 251 MiB, flat; docs/benchmarks.md). ``ho_onnx``'s own
    generation loop shrinks it after every run (:func:`ho_onnx.target.ort.generate.greedy`)."""
    from ...graph.protos import graph_inputs

    inputs = _read(model, graph_inputs)
    if inputs is None:
        return "ort"
    for v in inputs:
        t = v.type.tensor_type
        if not v.type.HasField("tensor_type") or not t.HasField("shape") or any(
                not d.HasField("dim_value") or d.dim_value < 0 for d in t.shape.dim):
            return "ort"
    return "as_requested"


def ort_reuse_of(model: str | os.PathLike[str] | bytes | None) -> bool:
    """Whether ``model``'s plan counted ORT's buffer reuse: False where it was planned for
    sessions without it (``ho_onnx.ort_reuse`` = 0: ``OffloadOptions.ort_reuse``), which
    :func:`session_options` then turns off; True for any other model (ORT's default)."""
    from ...graph.protos import model_metadata

    meta = _read(model, model_metadata)
    return meta is None or planned_reuse(meta)


def planned_reuse(metadata: Mapping[str, str]) -> bool:
    """Whether a model of these ``metadata_props`` was planned with ORT's buffer reuse."""
    from ...contract import META_ORT_REUSE, META_PREFIX

    return metadata.get(META_PREFIX + META_ORT_REUSE) != "0"


def refuse_no_reuse(reuse: bool, host: str, error: type[Exception] = ModelLoadError) -> None:
    """Raise ``error`` for a model planned without ORT's buffer reuse (``reuse`` False:
    :func:`ort_reuse_of`, :func:`planned_reuse`) that is to run in ``host``, which cannot
    turn it off (ORT's C API has no call for it): its arena would hold more than counted."""
    if not reuse:
        raise error(f"the model was planned for ONNX Runtime sessions without buffer reuse "
                    f"(--ort-reuse off), which {host} cannot turn off (ORT's C API has no "
                    f"call for it), so its arena would exceed the plan: optimize it again "
                    f"with --ort-reuse on (the default)")


def _read(model: str | os.PathLike[str] | bytes | None, read: Callable[[Any], Any]) -> Any:
    """``read`` of ``model``'s serialized bytes (a file mapped: the weights' pages are
    skipped, never read), or None for no model or one unreadable (ORT reports that when it
    loads it)."""
    import mmap

    if model is None:
        return None
    try:
        if isinstance(model, bytes):
            return read(model)
        with open(os.fspath(model), "rb") as f, \
                mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return read(m)
    except Exception:  # (any failure: ORT's load says what is wrong)
        return None


def _config(so: ort.SessionOptions, key: str) -> str:
    """``so``'s config entry ``key``, "" when unset (ORT raises for a missing key)."""
    try:
        return so.get_session_config_entry(key)
    except RuntimeError:
        return ""

_ENV_ARENA_LOCK = threading.Lock()
_ENV_ARENA: list[bool] = []  # [registered] once tried


def cpu_arena_shared() -> bool:
    """Register, once per process, ORT's CPU arena grown by what is requested
    (``arena_extend_strategy`` 1, kSameAsRequested) as the environment's CPU allocator, which
    sessions with ``session.use_env_allocators`` = 1 use instead of their own (grown by powers
    of two). False where ORT refuses it (another CPU allocator registered by the caller: the
    sessions then keep their own arenas)."""
    with _ENV_ARENA_LOCK:
        if not _ENV_ARENA:
            try:
                info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0,
                                         ort.OrtMemType.DEFAULT)
                ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, 1, -1, -1))
                _ENV_ARENA.append(True)
            except Exception:  # (ORT raises its own types; never fail a session for it)
                _ENV_ARENA.append(False)
        return _ENV_ARENA[0]


_COPIED = (
    "enable_cpu_mem_arena",
    "enable_mem_pattern",
    "enable_mem_reuse",
    "enable_profiling",
    "execution_mode",
    "execution_order",
    "graph_optimization_level",
    "inter_op_num_threads",
    "intra_op_num_threads",
    "log_severity_level",
    "log_verbosity_level",
    "logid",
    "optimized_model_filepath",
    "profile_file_prefix",
    "use_deterministic_compute",
)


# Session config keys of onnxruntime_session_options_config_keys.h (API 21), and ours.
_CONFIG_KEYS = (
    "session.disable_prepacking",
    "session.use_env_allocators",
    "session.load_model_format",
    "session.save_model_format",
    "session.set_denormal_as_zero",
    "session.disable_quant_qdq",
    "session.disable_double_qdq_remover",
    "session.enable_quant_qdq_cleanup",
    "optimization.enable_gelu_approximation",
    "session.disable_aot_function_inlining",
    "optimization.memory_optimizer_config",
    "optimization.enable_memory_probe_recompute_config",
    "optimization.disable_specified_optimizers",
    "session.use_device_allocator_for_initializers",
    "session.inter_op.allow_spinning",
    "session.intra_op.allow_spinning",
    "session.use_ort_model_bytes_directly",
    "session.use_ort_model_bytes_for_initializers",
    "session.qdqisint8allowed",
    "session.x64quantprecision",
    "optimization.minimal_build_optimizations",
    "ep.nnapi.partitioning_stop_ops",
    "session.dynamic_block_base",
    "session.force_spinning_stop",
    "session.strict_shape_type_inference",
    "session.allow_released_opsets_only",
    "session.node_partition_config_file",
    "session.intra_op_thread_affinities",
    "session.debug_layout_transformation",
    "session.disable_cpu_ep_fallback",
    "session.optimized_model_external_initializers_file_name",
    "session.optimized_model_external_initializers_min_size_in_bytes",
    "session.model_external_initializers_file_folder_path",
    "session.save_external_prepacked_constant_initializers",
    "session.collect_node_memory_stats_to_file",
    "session.resource_cuda_partitioning_settings",
    "ep.context_enable",
    "ep.context_file_path",
    "ep.context_embed_mode",
    "ep.context_node_name_prefix",
    "ep.share_ep_contexts",
    "ep.context_model_external_initializers_file_name",
    "mlas.enable_gemm_fastmath_arm64_bfloat16",
    "session.qdq_matmulnbits_accuracy_level",
    "ep.dynamic.workload_type",
    CONFIG_MODEL_DIR,
    CONFIG_HOST_BYTES,
    CONFIG_HOST_POOL_LIMIT,
    CONFIG_SAMPLE_ARENA,
)


def _copy_options(
    src: ort.SessionOptions, dst: ort.SessionOptions, skip: tuple[str, ...] = ()
) -> None:
    # onnxruntime.SessionOptions has no copy() and cannot list its config entries: the
    # attributes above and the known config keys travel; custom-op libraries, providers,
    # free-dimension overrides and added initializers do not.
    for name in _COPIED:
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))
    for key in _CONFIG_KEYS:
        if key in skip:
            continue
        try:
            value = src.get_session_config_entry(key)
        except RuntimeError:
            continue
        dst.add_session_config_entry(key, value)


CUDA_EP = "CUDAExecutionProvider"


def cuda_arena_options(device_limit: int | None = None, *, as_requested: bool = True
                       ) -> dict[str, str]:
    """CUDA EP options that make ORT's arena hold what the plan predicts.

    By default ORT's CUDA arena grows by powers of two (``kNextPowerOfTwo``): a plan that
    peaks at 50% of the card can still reserve all of it. ``kSameAsRequested`` grows it by
    what is asked for (``as_requested``; not for a model whose runs ask for more and more,
    :func:`arena_for`). ``device_limit`` (bytes) also caps the arena (``gpu_mem_limit``):
    an allocation beyond it fails instead of taking more of the card.
    """
    opts = {"arena_extend_strategy": "kSameAsRequested"} if as_requested else {}
    if device_limit is not None:
        if device_limit <= 0:
            raise ValueError(f"device_limit must be positive, got {device_limit}")
        opts["gpu_mem_limit"] = str(int(device_limit))
    return opts


def with_cuda_arena(providers: list[Any], device_limit: int | None = None, *,
                    as_requested: bool = True) -> list[Any]:
    """``providers`` with :func:`cuda_arena_options` under the CUDA EP; options the caller
    gave for it win."""
    out: list[Any] = []
    for p in providers:
        name, given = (p, {}) if isinstance(p, str) else (p[0], dict(p[1]))
        opts = cuda_arena_options(device_limit, as_requested=as_requested)
        out.append((name, {**opts, **given}) if name == CUDA_EP else p)
    return out


def InferenceSession(  # mirrors onnxruntime.InferenceSession
    path: str | os.PathLike[str] | bytes,
    providers: list[Any] | None = None,
    sess_options: ort.SessionOptions | None = None,
    execution_order: str = "priority",
    *,
    model_dir: str | os.PathLike[str] | None = None,
    device_limit: int | None = None,
    memory_patterns: bool = False,
    cpu_arena: str = "auto",
    buffer_reuse: bool | None = None,
    **kw: Any,
) -> ort.InferenceSession:
    """An ``onnxruntime.InferenceSession`` that runs ho-onnx's cache operators.

    ``path`` is a model file (offloaded weights resolve in its folder) or serialized model
    bytes; bytes with offloaded weights need ``model_dir``, the folder their data files are
    in (or ``ho_onnx.model_dir`` in ``sess_options``). Under the CUDA EP the arena grows by
    what is requested, not by powers of two, where the CPU arena does (``cpu_arena``,
    :func:`session_options`; ``"auto"``: only for a model of fixed input shapes,
    :func:`arena_for`), and ``device_limit`` (bytes) caps it (:func:`cuda_arena_options`).
    ORT's memory patterns are off unless ``memory_patterns``; its buffer reuse is off
    where the model's plan counted none, or ``buffer_reuse`` is False
    (:func:`session_options`).
    """
    model_path = None if isinstance(path, bytes) else path
    if isinstance(path, bytes) and model_dir is None and not _has_model_dir(sess_options):
        _refuse_offloaded_weights(path)
    if cpu_arena == "auto":  # (any other value: session_options checks it)
        cpu_arena = arena_for(path)
    so = session_options(model_path, base=sess_options, execution_order=execution_order,
                         model_dir=model_dir, memory_patterns=memory_patterns,
                         cpu_arena=cpu_arena,
                         buffer_reuse=ort_reuse_of(path) if buffer_reuse is None else buffer_reuse)
    model = path if isinstance(path, bytes) else os.fspath(path)
    return ort.InferenceSession(
        model, sess_options=so,
        providers=with_cuda_arena(providers or ["CPUExecutionProvider"], device_limit,
                                  as_requested=cpu_arena == "as_requested"), **kw
    )


def _has_model_dir(so: ort.SessionOptions | None) -> bool:
    try:
        return so is not None and bool(so.get_session_config_entry(CONFIG_MODEL_DIR))
    except RuntimeError:
        return False


def _refuse_offloaded_weights(model_bytes: bytes) -> None:
    """A model given as bytes has no folder: one with offloaded weights needs ``model_dir``."""
    import onnx

    model = onnx.ModelProto()
    try:
        model.ParseFromString(model_bytes)
    except Exception:  # ORT reports a model it cannot parse
        return
    for node in model.graph.node:
        if node.domain == contract.DOMAIN and node.op_type == contract.PREFETCH and any(
            a.name == contract.ATTR_LOCATION for a in node.attribute
        ):
            raise ModelLoadError(
                "the model given as bytes has offloaded weights but no model directory: pass "
                "model_dir= (the folder of its data files; session config entry "
                f"{CONFIG_MODEL_DIR!r})"
            )


def counters() -> dict[str, int]:
    """Process-wide counters of the library (bytes moved, waits, host memory held, engines)."""
    return dict(_ops().counters())


def reset_counters() -> None:
    """Reset the monotonic counters (bytes, counts, wait time); memory gauges are kept."""
    _ops().reset_counters()


def build_info() -> dict[str, Any]:
    """How the library was built (version, ORT API version, CUDA, compiler, element types)."""
    return dict(_ops().build_info())
