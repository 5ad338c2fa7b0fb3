"""LLM generation benchmark: time to first token and decode tokens/s over contexts.

Greedy generation with a key/value cache (issue 36): a random prompt of each context length
is prefilled in chunks of ``--chunk`` tokens (the cache fed back between chunks), then
``--new-tokens`` decode steps of one token each. The model is ``models.decoder``'s GPT-style
decoder with Optimum's cache layout (``past_key_values.{i}.key`` in, ``present.{i}.key``
out; grouped-query attention with ``--kv-heads``), built here (no hub, no optimum).

Rows (each measured in its own process, so the arena and the RSS start clean):

* ``ort``            the unmodified model in a plain ONNX Runtime session (resident);
* ``ho N%``          ho-onnx, weights offloaded, planned for N % of the resident peak
  (``ho_onnx.optimize`` with ``OffloadOptions(budget=...)`` and one range plan per context:
  ``seq`` 1..chunk, ``past`` 0..context + new tokens - 1);
* ``ho floor``       the same at the smallest budget the planner meets with ORT's replayed
  arena within it too (the plan at the tensors' floor, the planner's ``min_budget``, says
  which budget its arena fits: ``Plan.arena_fits_at``; both in the JSON);
* ``ho weights+KV floor``  weights and the KV cache offloaded (``OffloadOptions.kv``)
  at that configuration's floor; skipped, with the reason, while ``OffloadOptions`` has no
  ``kv`` field;
* ``hf``             the same dims in transformers (``LlamaForCausalLM`` from a config with
  the same layers, hidden, heads, kv heads, MLP width and vocabulary; random weights: its
  tokens are not comparable) with a ``DynamicCache``;
* ``hf offloaded``   the same with the cache offloaded (``DynamicCache(offloading=True)`` /
  ``OffloadedCache``) and ``accelerate.cpu_offload`` (GPU only: on the CPU there is nowhere to
  offload to). Rows torch or transformers cannot run are skipped with the reason.

Every ONNX row's greedy tokens are checked identical to the ``ort`` row's at the same context
(the same model, offloaded or not): a mismatch is printed loudly instead of its numbers and
the exit status is 1. Per row: median time to first token (prefill), median decode tokens/s
over ``--repeats`` generations (after a short warm-up), memory: on the CPU the process's peak
RSS above its RSS before the session (``ru_maxrss``), on CUDA the device bytes in use above
those before (``cudaMemGetInfo`` polled every ms); ho rows also ORT's arena ``MaxInUse``
sampled by the library at every Wait (``ho_onnx.sample_arena=1``). With ``--device cuda``
every ONNX session must run on CUDAExecutionProvider (``get_providers()``) or the row is
refused, not printed; the cache stays on the device between steps (IOBinding), except in the
weights+KV row, where the caller's cache is in host memory.

    python bench/llm_generate.py --json out.json                  # CPU: 512, 2k, 8k
    python bench/llm_generate.py --quick --json out.json          # tiny model, 2 contexts (CI)
    python bench/llm_generate.py --device cuda --json out.json    # >= 1B fp16, up to 32k
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in (ROOT, ROOT / "bench"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

CUDA_EP = "CUDAExecutionProvider"
CPU_EP = "CPUExecutionProvider"
MIB = 1 << 20

# Model and run sizes per preset; every value can be overridden on the command line.
PRESETS: dict[str, dict[str, Any]] = {
    "cpu": {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 1024, "vocab": 8192,
            "dtype": "float32", "contexts": "512,2048,8192", "chunk": 512, "new_tokens": 32,
            "repeats": 3, "budgets": "1.0,0.8", "machine": "cpu"},
    "cuda": {"layers": 20, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192,
             "vocab": 32000, "dtype": "float16", "contexts": "2048,8192,32768", "chunk": 2048,
             "new_tokens": 32, "repeats": 3, "budgets": "1.0,0.9", "machine": "h100"},
    "quick": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 256, "vocab": 256,
              "dtype": "float32", "contexts": "16,64", "chunk": 32, "new_tokens": 4,
              "repeats": 1, "budgets": "1.0", "machine": "cpu"},
}
MODEL_KEYS = ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "dtype")


def kv_offload_supported() -> bool:
    """Whether this ho_onnx's ``OffloadOptions`` has the ``kv`` field."""
    from ho_onnx.schedule.options import OffloadOptions

    return "kv" in {f.name for f in dataclasses.fields(OffloadOptions)}


# ---- one generation (child process) -----------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _reset_peak_rss() -> None:
    """Start the process's peak RSS (VmHWM) again from its current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # (then the peak since the process started: imports included)


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # (KiB on Linux)


def _prompt(ctx: int, vocab: int) -> Any:
    import numpy as np

    return np.random.default_rng(ctx).integers(0, vocab, (1, ctx), dtype=np.int64)


class OnnxGenerator:
    """Greedy generation through ``ho_onnx.target.ort.generate``'s loop: the cache in its
    ``KvBuffers`` on ``kv_device`` (``cpu``/``cuda``) from one run to the next, only the last
    position's logits come back; ORT's arenas (``shrink``, ORT's list) shrunk after every
    run."""

    def __init__(self, sess: Any, layout: Any, kv_device: str, shrink: str | None) -> None:
        from ho_onnx.target.ort.generate import shrink_options

        self.sess, self.layout, self.kv_device = sess, layout, kv_device
        self.shrink = shrink_options(shrink)
        self.binding = sess.io_binding()
        self.runs = 0

    def generate(self, prompt: Any, chunk: int, new_tokens: int) -> dict[str, Any]:
        from ho_onnx.target.ort.generate import KvBuffers, _step, prefill

        cache = KvBuffers(self.layout, prompt.shape[1] + new_tokens, device=self.kv_device)
        ids = [int(t) for t in prompt[0]]
        t0 = time.perf_counter()
        token = prefill(self.sess, self.binding, self.layout, cache, ids, chunk, self.shrink)
        self.runs += -(-len(ids) // chunk)
        ttft = time.perf_counter() - t0
        tokens = [token]
        t0 = time.perf_counter()
        for _ in range(new_tokens):
            token = _step(self.sess, self.binding, self.layout, cache, [token], self.shrink)
            self.runs += 1
            tokens.append(token)
        decode = time.perf_counter() - t0
        return {"ttft_s": ttft, "decode_s": decode, "tokens": tokens, "pinned": cache.pinned}


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


class HfGenerator:
    """The same loop in transformers: chunked prefill and decode through the model's cache."""

    def __init__(self, model: Any, device: str, offloaded: bool) -> None:
        self.model, self.device, self.offloaded = model, device, offloaded

    def _cache(self) -> Any:
        from transformers import DynamicCache

        if not self.offloaded:
            return DynamicCache()
        try:
            return DynamicCache(offloading=True)
        except TypeError:  # transformers < 4.56
            from transformers import OffloadedCache

            return OffloadedCache()

    def generate(self, prompt: Any, chunk: int, new_tokens: int) -> dict[str, Any]:
        import torch

        ids = torch.from_numpy(prompt).to(self.device)
        cache = self._cache()
        with torch.inference_mode():
            t0 = time.perf_counter()
            for lo in range(0, ids.shape[1], chunk):
                out = self.model(input_ids=ids[:, lo:lo + chunk], past_key_values=cache,
                                 use_cache=True, logits_to_keep=1)
                cache = out.past_key_values
            token = int(out.logits[0, -1].argmax())
            _sync(self.device)
            ttft = time.perf_counter() - t0
            tokens = [token]
            t0 = time.perf_counter()
            for _ in range(new_tokens):
                step = torch.tensor([[token]], device=self.device)
                out = self.model(input_ids=step, past_key_values=cache, use_cache=True,
                                 logits_to_keep=1)
                cache = out.past_key_values
                token = int(out.logits[0, -1].argmax())
                tokens.append(token)
            _sync(self.device)
            decode = time.perf_counter() - t0
        return {"ttft_s": ttft, "decode_s": decode, "tokens": tokens}


def _hf_model(cfg: dict[str, Any], ctx: int, device: str, offloaded: bool) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.float16 if cfg["dtype"] == "float16" else torch.float32
    conf = LlamaConfig(hidden_size=cfg["hidden"], intermediate_size=cfg["ffn"],
                       num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                       num_key_value_heads=cfg["kv_heads"], vocab_size=cfg["vocab"],
                       max_position_embeddings=ctx + cfg["new_tokens"], torch_dtype=dtype)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(conf)
    model = model.to_empty(device="cpu")
    for p in model.parameters():  # (RMSNorm gains 1, the rest N(0, 0.02))
        torch.nn.init.ones_(p) if p.dim() == 1 else torch.nn.init.normal_(p, std=0.02)
    model = model.to(dtype).eval()
    model.model.rotary_emb = type(model.model.rotary_emb)(conf)  # (buffers: not meta)
    if device == "cuda":
        if offloaded:
            from accelerate import cpu_offload

            cpu_offload(model, execution_device=torch.device("cuda:0"))
        else:
            model = model.to("cuda")
    return model


INT32_ELEMENTS = 2**31 - 1


def context_chunk(cfg: dict[str, Any], ctx: int) -> int:
    """The prefill chunk at context ``ctx``: ``cfg["chunk"]``, halved until a chunk's attention
    scores (heads x chunk x keys, keys up to the range's top) stay under 2**31 elements. ORT's
    CUDA kernels index elements with int32 (fast_divmod: the unmodified model fails at 32k
    context with 2,048-token chunks and 32 heads, H200 stop 46)."""
    chunk = cfg["chunk"]
    while chunk > 1 and cfg["heads"] * chunk * (ctx + cfg["new_tokens"] + chunk) > INT32_ELEMENTS:
        chunk //= 2
    return chunk


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One row at one context: warm-up, ``repeats`` timed generations, memory."""
    cfg = json.loads(args.cfg)
    ctx, chunk, new = args.ctx, context_chunk(cfg, args.ctx), cfg["new_tokens"]
    prompt = _prompt(ctx, cfg["vocab"])
    cuda = args.device == "cuda"
    if args.kind == "onnx":  # imports before the RSS baseline
        import onnxruntime as ort

        import ho_onnx
        from ho_onnx.contract import CONFIG_SAMPLE_ARENA
    else:
        import torch
        import transformers  # noqa: F401
    poller = None
    if cuda:
        from gpu_offload import MemPoller

        from ho_onnx import _ops

        _ops.cuda_mem_info(0)  # the CUDA context exists before the first sample
        poller = MemPoller().__enter__()
    _reset_peak_rss()
    rss0 = _rss_bytes()
    out: dict[str, Any] = {}
    if args.kind == "onnx":
        providers = ([(CUDA_EP, {"device_id": 0, "arena_extend_strategy": "kSameAsRequested"})]
                     if cuda else [CPU_EP])
        if args.optimized:
            so = ort.SessionOptions()
            so.add_session_config_entry(CONFIG_SAMPLE_ARENA, "1")
            sess = ho_onnx.InferenceSession(args.model, providers=providers, sess_options=so)
        else:
            sess = ort.InferenceSession(args.model, providers=providers)
        out["providers"] = sess.get_providers()
        if cuda and out["providers"][0] != CUDA_EP:
            return {"error": f"the session runs on {out['providers']}, not {CUDA_EP}: refused",
                    "providers": out["providers"]}
        from ho_onnx.target.ort.generate import grown_as_requested, kv_layout

        shrink = None if args.shrink_arenas == "off" else grown_as_requested(sess)
        gen: Any = OnnxGenerator(sess, kv_layout(args.model),
                                 "cpu" if args.kv_host or not cuda else "cuda", shrink)
    else:
        gen = HfGenerator(_hf_model(cfg, ctx, args.device, args.offloaded), args.device,
                          args.offloaded)
    gen.generate(prompt[:, :min(ctx, chunk)], chunk, 2)  # warm-up: kernels, arena, handles
    if args.kind == "onnx" and args.optimized:
        from ho_onnx import _ops

        _ops.reset_counters()
        runs0 = gen.runs
    results = [gen.generate(prompt, chunk, new) for _ in range(args.repeats)]
    if poller is not None:
        poller.__exit__(None, None, None)
    tokens = results[0]["tokens"]
    if any(r["tokens"] != tokens for r in results):
        return {"error": "tokens differ between repeats of the same row: "
                         f"{[r['tokens'] for r in results]}"}
    out.update({
        "ttft_s": statistics.median(r["ttft_s"] for r in results),
        "decode_tok_s": statistics.median(new / r["decode_s"] for r in results),
        "ttft_runs_s": [r["ttft_s"] for r in results],
        "decode_runs_s": [r["decode_s"] for r in results],
        "tokens": tokens,
        "rss_delta_bytes": max(0, _peak_rss_bytes() - rss0),
        "kv_pinned": results[0].get("pinned"),
    })
    if poller is not None:
        out["device_peak_bytes"] = poller.peak_bytes
    if args.kind == "onnx" and args.optimized:
        from ho_onnx import _ops

        c = _ops.counters()
        runs = max(1, gen.runs - runs0)
        out["arena_max_in_use"] = c["ort_arena_max_in_use"] if c["ort_arena_max_in_use"] >= 0 \
            else None
        # (the arena's regions at the last Wait: the most it reserved where nothing shrinks it)
        out["arena_total_allocated"] = c["ort_arena_total_allocated"] \
            if c["ort_arena_total_allocated"] >= 0 else None
        out["loaded_bytes_per_run"] = c["bytes_loaded"] // runs
        out["host_store_bytes"] = c["host_store_bytes"]
    if args.kind == "hf" and cuda:
        import torch

        out["torch_max_allocated"] = torch.cuda.max_memory_allocated()
    return out


def run_child(argv: list[str], timeout: float) -> dict[str, Any]:
    """One row in its own process; its RESULT line, or the error it ended with."""
    try:
        p = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (p.stderr or p.stdout).strip().splitlines()[-4:]
    return {"error": f"exit {p.returncode}: " + " | ".join(tail)}


# ---- the benchmark ----------------------------------------------------------------------------

def hf_skip_reason(device: str, offloaded: bool) -> str | None:
    """Why the transformers row cannot run here, or None."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        return f"torch/transformers not installed ({e.name})"
    if device == "cuda" and not torch.cuda.is_available():
        return f"torch {torch.__version__} has no CUDA"
    if offloaded:
        if device != "cuda":
            return ("the offloaded cache and accelerate's cpu_offload move to the CPU: "
                    "on the CPU device there is nowhere to offload to")
        try:
            import accelerate  # noqa: F401
        except ImportError:
            return "accelerate is not installed"
    return None


def preflight(device: str) -> str | None:
    """Why this benchmark cannot run on ``device`` here, or None."""
    try:
        from ho_onnx import _ops
    except ImportError as e:
        return f"the ho_onnx native library is not built ({e})"
    if device == "cuda":
        from gpu_offload import preflight as gpu_preflight

        return gpu_preflight()
    del _ops
    return None


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:.1f}"


def _options(budget: int, kv: bool) -> Any:
    from ho_onnx.schedule.options import OffloadOptions

    return OffloadOptions(budget=budget, kv=True) if kv else OffloadOptions(budget=budget)


def floor_of(src: Path, dims: dict, ranges: dict, costs: Any, kv: bool,
             arena: bool = False) -> tuple[int, int]:
    """The smallest budget the planner meets for ``src`` over ``ranges`` (its tensors), and,
    with ``arena``, the budget the plan at that floor says its replayed ORT arena fits
    (``Plan.arena_fits_at``; the tensors' floor where it fits there or none was found)."""
    from ho_onnx.rewrite.pipeline import plan_model
    from ho_onnx.schedule.planner import InfeasibleBudgetError

    def plan(budget: int) -> Any:
        return plan_model(src, _options(budget, kv), dims, costs, dim_ranges=ranges)[2]

    try:
        floor = int(plan(1).planned.peak_bytes)  # (1 byte fits: nothing is resident)
    except InfeasibleBudgetError as e:
        floor = int(e.min_budget)
    return floor, (plan(floor).arena_fits_at or floor) if arena else floor


def main(argv: list[str] | None = None) -> int:
    presets = "\n".join(f"  {k:<6}" + ", ".join(f"{n}={v}" for n, v in p.items())
                         for k, p in PRESETS.items())
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"presets (--device cpu / cuda, --quick; options override them):\n{presets}\n"
               "exit status: 0 all rows ran with identical tokens; 1 a token mismatch or a "
               "failed ONNX row; 2 bad options or a machine that cannot run the device")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--quick", action="store_true",
                    help="tiny model, 2 short contexts, 4 tokens, 1 repeat (the CI test)")
    for key, kind, what in (
            ("layers", int, "transformer blocks"), ("hidden", int, "model width"),
            ("heads", int, "query heads"), ("kv-heads", int, "key/value heads (GQA)"),
            ("ffn", int, "MLP width"), ("vocab", int, "vocabulary"),
            ("contexts", str, "comma-separated prompt lengths"),
            ("chunk", int, "prefill chunk (tokens per prefill run)"),
            ("new-tokens", int, "decode steps after the prefill"),
            ("repeats", int, "timed generations per row (median)"),
            ("budgets", str, "fractions of the resident peak for the 'ho N%%' rows "
                             "(the floor row is always added)"),
            ("machine", str, "cost-model machine: preset (cpu, h100, h200) or a "
                             "calibration JSON")):
        ap.add_argument(f"--{key}", type=kind, default=None,
                        help=f"{what} (default: per --device / --quick preset)")
    ap.add_argument("--dtype", choices=["float32", "float16"], default=None)
    ap.add_argument("--no-hf", action="store_true", help="leave out the transformers rows")
    ap.add_argument("--workdir", default=None, help="where the models go (default: temp dir)")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per measured row")
    ap.add_argument("--shrink-arenas", choices=["auto", "off"], default="auto",
                    help="auto: the session's arenas that grow by what is requested "
                         "(generate.grown_as_requested) shrunk after every run "
                         "(generate.shrink_options); off: never")
    ap.add_argument("--child", choices=["onnx", "hf"], dest="kind", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--optimized", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--offloaded", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kv-host", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ctx", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cfg", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.kind:
        args.repeats = args.repeats or 1
        print("RESULT " + json.dumps(measure(args)), flush=True)
        return 0
    # SIGTERM (a time bound, scripts/gpu_run.sh) ends the run as an exception would: the
    # row's child is killed by subprocess.run, the JSON keeps the rows measured so far.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    why = preflight(args.device)
    if why is not None:
        print(f"llm_generate: cannot run on {args.device} here: {why}", file=sys.stderr)
        return 2
    preset = PRESETS["quick" if args.quick else args.device]
    cfg = {k: getattr(args, k) if getattr(args, k) is not None else preset[k] for k in preset}
    try:
        contexts = [int(c) for c in str(cfg["contexts"]).split(",") if c.strip()]
        fractions = [float(f) for f in str(cfg["budgets"]).split(",") if f.strip()]
        if not contexts or min(contexts) <= 0 or cfg["chunk"] <= 0 or cfg["new_tokens"] <= 0:
            raise ValueError("contexts, chunk and new tokens must be positive")
        if cfg["repeats"] <= 0 or any(not 0 < f <= 1 for f in fractions):
            raise ValueError("repeats must be positive and budgets fractions in (0, 1]")
    except ValueError as e:
        print(f"llm_generate: error: {e}", file=sys.stderr)
        return 2
    return run(args, cfg, contexts, fractions)


def run(args: argparse.Namespace, cfg: dict[str, Any], contexts: list[int],
        fractions: list[float]) -> int:
    import onnxruntime as ort

    import ho_onnx
    from ho_onnx import CostSource
    from models.decoder import build_decoder_once, decoder_config_bytes

    device = args.device
    # A range plan is made at the top of every range at once (past and chunk together), so the
    # position table must hold past + chunk (the model's own table is checked at plan time).
    top = max(contexts) + cfg["new_tokens"] + cfg["chunk"]
    model_cfg = {**{k: cfg[k] for k in MODEL_KEYS}, "seq": "seq", "batch": "batch",
                 "kv_cache": True, "cache_layout": "optimum", "past": "past",
                 "max_positions": top}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="ho_llm_generate_"))
    work.mkdir(parents=True, exist_ok=True)
    sizes = decoder_config_bytes(**{k: cfg[k] for k in MODEL_KEYS if k != "dtype"},
                                 dtype=cfg["dtype"], max_positions=top)
    t0 = time.perf_counter()
    src, built = build_decoder_once(work, model_cfg)
    print(f"model: {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} heads "
          f"({cfg['kv_heads']} kv), MLP {cfg['ffn']}, vocab {cfg['vocab']}, {cfg['dtype']}: "
          f"{sizes['total_params'] / 1e6:.1f} M parameters, {_mib(sizes['total_bytes'])} MiB"
          + (f" (built in {time.perf_counter() - t0:.1f} s)" if built else " (cached)"),
          flush=True)
    costs = CostSource(machine=cfg["machine"])
    dims = {"batch": 1}
    child_cfg = json.dumps(cfg)
    kv_ok = kv_offload_supported()
    load0 = os.getloadavg()  # (a shared machine: its load says how far to trust the times)
    rows: list[dict[str, Any]] = []
    failures: list[str] = []

    def save(done: bool) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"device": device, "config": cfg, "contexts": contexts,
                 "shrink_arenas": args.shrink_arenas,
                 "weight_bytes": sizes["total_bytes"], "params": sizes["total_params"],
                 "onnxruntime": ort.__version__, "ho_onnx": ho_onnx.__version__,
                 "cpu_count": os.cpu_count(), "loadavg_start": load0,
                 "loadavg_now": os.getloadavg(), "rows": rows, "failures": failures,
                 "complete": done}, indent=2) + "\n")

    def measure_row(row: dict[str, Any], argv: list[str], ref: dict[str, Any] | None) -> None:
        print(f"  {row['name']} ...", flush=True)
        res = run_child(["--device", device, "--ctx", str(row["context"]), "--cfg", child_cfg,
                         "--repeats", str(cfg["repeats"]), "--shrink-arenas", args.shrink_arenas,
                         *argv], args.timeout)
        row.update(res)
        if "error" not in row and row["kind"] == "onnx" and ref is not None:
            if "tokens" not in ref:
                row["tokens_match"] = None
            else:
                row["tokens_match"] = row["tokens"] == ref["tokens"]
                if not row["tokens_match"]:
                    msg = (f"TOKEN MISMATCH at context {row['context']}: {row['name']} "
                           f"{row['tokens']} != ort {ref['tokens']}")
                    failures.append(msg)
                    print("!" * 8 + " " + msg, flush=True)
        rows.append(row)
        save(False)

    for ctx in contexts:
        chunk = context_chunk(cfg, ctx)
        if chunk < cfg["chunk"] and chunk < ctx:
            print(f"context {ctx}: prefill chunk {chunk}, not {cfg['chunk']} (heads x chunk x "
                  "context must stay under 2**31 elements: ORT's CUDA kernels index with int32)",
                  flush=True)
        ranges = {"seq": (1, min(chunk, ctx)), "past": (0, ctx + cfg["new_tokens"] - 1)}
        # the plan timed at a decode step of this context: its predicted per-token time
        decode = {"decode": {"seq": 1, "past": ctx}}
        print(f"context {ctx} (plan ranges {ranges}):", flush=True)
        base = {"context": ctx, "kind": "onnx"}
        ref = {**base, "name": "ort", "budget_bytes": None}
        measure_row(ref, ["--child", "onnx", "--model", str(src)], None)
        if "error" in ref:
            failures.append(f"ort row at context {ctx}: {ref['error']}")
        t0 = time.perf_counter()
        _, _, resident = ho_onnx.plan_model(src, _options(1 << 62, False), dims, costs,
                                            dim_ranges=ranges)
        peak = int(resident.baseline.peak_bytes)
        ref["predicted_peak_bytes"] = peak
        tensor_floor, floor = floor_of(src, dims, ranges, costs, kv=False, arena=True)
        print(f"  resident peak {_mib(peak)} MiB, floor {_mib(floor)} MiB (its tensors "
              f"{_mib(tensor_floor)} MiB) "
              f"(planned in {time.perf_counter() - t0:.1f} s)", flush=True)
        budgets = [(f"ho {f:.0%}", int(f * peak)) for f in fractions]
        budgets.append(("ho floor", floor))
        for name, budget in budgets:
            if budget < tensor_floor:  # (between the two floors: planned, its arena OVER)
                rows.append({**base, "name": name, "budget_bytes": budget,
                             "skipped": f"below the floor ({_mib(tensor_floor)} MiB)"})
                continue
            out = src.with_name(f"decoder.c{ctx}.{name.split()[-1].replace('%', 'pct')}.onnx")
            row = {**base, "name": name, "budget_bytes": budget,
                   **({"tensor_floor_bytes": tensor_floor} if name == "ho floor" else {})}
            try:
                r = ho_onnx.optimize(src, out, _options(budget, False), dims, costs=costs,
                                     dim_ranges=ranges, dim_points=decode)
            except Exception as e:  # an impossible budget is a row of its own, not a crash
                rows.append({**row, "error": f"plan: {e}"})
                continue
            row.update(predicted_peak_bytes=r.plan.planned.peak_bytes,
                       predicted_arena_bytes=r.plan.arena_bytes,
                       offloaded_weights=len(r.choice.weights),
                       predicted_token_s=r.points["decode"].seconds)
            measure_row(row, ["--child", "onnx", "--model", str(out), "--optimized"], ref)
        kv_row = {**base, "name": "ho weights+KV floor"}
        if not kv_ok:
            kv_row["skipped"] = ("this ho_onnx's OffloadOptions has no kv field "
                                 "(the KV cache is not an offload kind yet)")
            print(f"  {kv_row['name']}: skipped: {kv_row['skipped']}", flush=True)
            rows.append(kv_row)
        else:
            try:
                kv_tensors, kv_floor = floor_of(src, dims, ranges, costs, kv=True, arena=True)
                out = src.with_name(f"decoder.c{ctx}.kvfloor.onnx")
                r = ho_onnx.optimize(src, out, _options(kv_floor, True), dims, costs=costs,
                                     dim_ranges=ranges, dim_points=decode)
            except Exception as e:
                rows.append({**kv_row, "error": f"plan: {e}"})
            else:
                kv_row.update(budget_bytes=kv_floor, tensor_floor_bytes=kv_tensors,
                              predicted_peak_bytes=r.plan.planned.peak_bytes,
                              predicted_arena_bytes=r.plan.arena_bytes,
                              predicted_token_s=r.points["decode"].seconds)
                measure_row(kv_row, ["--child", "onnx", "--model", str(out), "--optimized",
                                     "--kv-host"], ref)
        if args.no_hf:
            continue
        for name, offloaded in (("hf", False), ("hf offloaded", True)):
            row = {"context": ctx, "kind": "hf", "name": name, "tokens_match": None}
            why = hf_skip_reason(device, offloaded)
            if why is not None:
                row["skipped"] = why
                print(f"  {name}: skipped: {why}", flush=True)
                rows.append(row)
                continue
            measure_row(row, ["--child", "hf", *(["--offloaded"] if offloaded else [])], None)
    for r in rows:
        if "error" in r and r["kind"] == "onnx" and not r.get("skipped"):
            failures.append(f"{r['name']} at context {r['context']}: {r['error']}")
    failures[:] = list(dict.fromkeys(failures))
    print_table(rows, device)
    if failures:
        print("\n" + "!" * 72)
        for f in failures:
            print(f"FAILED: {f}")
        print("!" * 72)
    if args.json:
        save(True)
        print(f"wrote {args.json}")
    return 1 if failures else 0


def print_table(rows: list[dict[str, Any]], device: str) -> None:
    mem = "dev peak" if device == "cuda" else "RSS +"
    hdr = (f"{'context':>8} {'row':<22}{'budget MiB':>11}{'pred MiB':>10}{'arena MiB':>10}"
           f"{mem + ' MiB':>13}{'MiB/run':>9}{'TTFT s':>9}{'tok/s':>9}{'x ort':>7}"
           f"{'pred tok/s':>11}  tokens")
    print()
    print(hdr)
    print("-" * len(hdr))
    ort_tps: dict[int, float] = {}
    for r in rows:
        head = f"{r['context']:>8} {r['name']:<22}"
        if r.get("skipped"):
            print(f"{head}skipped: {r['skipped']}")
            continue
        if "error" in r:
            print(f"{head}ERROR: {r['error'][:160]}")
            continue
        if r.get("tokens_match") is False:
            print(f"{head}!!! TOKENS DIFFER FROM ort: no numbers !!!")
            continue
        if r["name"] == "ort":
            ort_tps[r["context"]] = r["decode_tok_s"]
        memory = r.get("device_peak_bytes") if device == "cuda" else r.get("rss_delta_bytes")
        ratio = (r["decode_tok_s"] / ort_tps[r["context"]]) if r["context"] in ort_tps else None
        match = {True: "= ort", False: "DIFFER", None: "n/a"}[r.get("tokens_match")]
        if r["name"] == "ort":
            match = "reference"
        print(f"{head}{_mib(r.get('budget_bytes')):>11}{_mib(r.get('predicted_peak_bytes')):>10}"
              f"{_mib(r.get('arena_max_in_use')):>10}{_mib(memory):>13}"
              f"{_mib(r.get('loaded_bytes_per_run')):>9}"
              f"{r['ttft_s']:>9.3f}{r['decode_tok_s']:>9.1f}"
              f"{(f'{ratio:.2f}' if ratio else '-'):>7}"
              f"{(f'{1 / pred:.1f}' if (pred := r.get('predicted_token_s')) else '-'):>11}"
              f"  {match}")
    print("\nTTFT = prefill of the whole context (chunked) to the first token, median; tok/s = "
          "decode steps / their time, median; x ort = tok/s relative to the ort row; pred = the "
          "planner's simulated peak over the ranges; arena = ORT's arena MaxInUse sampled at "
          "the library's Waits (ho rows); MiB/run = bytes the library loaded per run (ho rows); "
          "pred tok/s = 1 / the plan's simulated decode step at the context (its 'decode' "
          "point: seq 1, past = context; ho rows, --machine's rates); "
          + ("dev peak = device bytes above those before the session (cudaMemGetInfo)"
             if device == "cuda" else "RSS + = process peak RSS above its RSS before the "
             "session (weights, host store and arena together)")
          + "; tokens: greedy tokens compared with the ort row (hf rows: other weights, n/a).")


if __name__ == "__main__":
    sys.exit(main())
