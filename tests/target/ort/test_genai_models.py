"""Real LLM exports with ORT contrib ops: a random-weight Llama through the onnxruntime-genai
builder (fp32, int4) and Optimum (text-generation-with-past, O2). Built locally (nothing from a
hub), once per module; needs the ``hf`` and ``genai`` extras."""

from __future__ import annotations

from collections import Counter

import onnx
import onnx_ir as ir
import pytest

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("optimum.onnxruntime")
pytest.importorskip("transformers")

from ho_onnx.graph.check import check_standard
from ho_onnx.target.ort.contrib import contrib_value_types, ort_check
from ho_onnx.target.ort.costs import weight_groups
from models.genai_export import build_hf_llama, export_genai, genai_greedy
from models.optimum_export import export_optimum, optimum_greedy

pytestmark = pytest.mark.slow

PROMPT = [1, 17, 42, 99, 5]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm")
    hf = build_hf_llama(root / "hf")
    untied = build_hf_llama(root / "hf_untied", tie=False)
    return {
        "hf": hf,
        "fp32": export_genai(hf, root / "genai_fp32", "fp32"),
        "int4": export_genai(hf, root / "genai_int4", "int4"),  # tied: GatherBlockQuantized
        "int4_zp": export_genai(untied, root / "genai_int4_zp", "int4", symmetric=False),
        "o2": export_optimum(hf, root / "optimum_o2", optimize="O2"),
    }


def _ops(path) -> Counter:
    m = onnx.load(str(path), load_external_data=False)
    return Counter((n.domain, n.op_type) for n in m.graph.node)


def _torch_greedy(hf, n_new: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf), local_files_only=True).eval()
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n_new)
    return [int(t) for t in out[0]]


def test_exports_carry_the_contrib_ops_onnx_refuses(exports):
    int4 = _ops(exports["int4"] / "model.onnx")
    assert int4[("com.microsoft", "MatMulNBits")] > 0
    assert int4[("com.microsoft", "GatherBlockQuantized")] == 1
    assert int4[("com.microsoft", "GroupQueryAttention")] == 4
    assert _ops(exports["o2"] / "model.onnx")[("", "SimplifiedLayerNormalization")] > 0
    for key in ("fp32", "int4", "int4_zp", "o2"):
        path = exports[key] / "model.onnx"
        with pytest.raises(onnx.checker.ValidationError):
            onnx.checker.check_model(str(path))
        model = onnx.load(str(path), load_external_data=False)
        assert ("", "SimplifiedLayerNormalization") in check_standard(model)
        ort_check(path)


def test_int4_weights_move_with_their_scales_and_zero_points(exports):
    tied = onnx.load(str(exports["int4"] / "model.onnx"), load_external_data=False)
    groups = weight_groups(ir.from_proto(tied).graph)
    gbq = next(n for n in tied.graph.node if n.op_type == "GatherBlockQuantized")
    lm_head = next(n for n in tied.graph.node if n.op_type == "MatMulNBits"
                   and n.name.startswith("/lm_head"))
    table = next(g for g in groups if lm_head.input[1] in g)  # gbq reads a Reshape of it
    assert table == (lm_head.input[1], lm_head.input[2]) and gbq.input[2] in table
    zp = onnx.load(str(exports["int4_zp"] / "model.onnx"), load_external_data=False)
    mm = [n for n in zp.graph.node if n.op_type == "MatMulNBits"]
    assert all(len(n.input) >= 4 for n in mm)
    groups = set(weight_groups(ir.from_proto(zp).graph))
    assert {(n.input[1], n.input[2], n.input[3]) for n in mm} <= groups


def test_ort_symbolic_shapes_size_what_onnx_inference_cannot(exports):
    model = onnx.load(str(exports["o2"] / "model.onnx"), load_external_data=False)
    dims = {"batch_size": 1, "sequence_length": 8, "past_sequence_length": 4}
    inferred = onnx.shape_inference.infer_shapes(model)
    onnx_known = {vi.name for vi in inferred.graph.value_info
                  if vi.type.tensor_type.HasField("shape")}
    outputs = [o for n in model.graph.node for o in n.output if o]
    types = contrib_value_types(model, dims)
    missing_onnx = [o for o in outputs if o not in onnx_known]
    assert missing_onnx  # SimplifiedLayerNormalization stops onnx's inference
    assert all(o in types and types[o].tensor_type.HasField("shape") for o in missing_onnx)
    sln = next(n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization")
    assert [d.dim_value for d in types[sln.output[0]].tensor_type.shape.dim] == [1, 8, 64]


def test_optimum_export_generates_what_transformers_generates(exports):
    want = _torch_greedy(exports["hf"], 12)
    assert len(set(want[len(PROMPT):])) > 3  # not one token repeated: a useful reference
    assert optimum_greedy(exports["o2"], PROMPT, max_new_tokens=12)[:len(want)] == want


def test_genai_exports_generate(exports):
    for key in ("fp32", "int4", "int4_zp"):
        tokens = genai_greedy(exports[key], PROMPT, max_length=len(PROMPT) + 12)
        assert tokens[:len(PROMPT)] == PROMPT and len(tokens) == len(PROMPT) + 12


# Dims of one prefill step: the genai builder's past/present share a buffer of
# past_sequence_length, total_sequence_length is what the mask covers.
GENAI_DIMS = ["batch_size=1", "sequence_length=8", "total_sequence_length=8",
              "past_sequence_length=0", "kv_cache_dim=16"]
OPTIMUM_DIMS = ["batch_size=1", "sequence_length=8", "past_sequence_length=4"]


def _weight_bytes(path) -> int:
    from ho_onnx.graph.load import expected_nbytes

    m = onnx.load(str(path), load_external_data=False)
    return sum(expected_nbytes(t) or 0 for t in m.graph.initializer)


def _cli(*args: str) -> str:
    from click.testing import CliRunner

    from ho_onnx.cli import main

    r = CliRunner().invoke(main, list(args))
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("key", ["fp32", "int4", "int4_zp", "o2"])
def test_plan_optimize_verify_at_half_the_weights(exports, tmp_path, key):
    folder = exports[key]
    dims = [a for d in (OPTIMUM_DIMS if key == "o2" else GENAI_DIMS) for a in ("--dim", d)]
    budget = str(_weight_bytes(folder / "model.onnx") // 2)
    plan = _cli("plan", str(folder), "--budget", budget, "--min-bytes", "0", *dims)
    assert "reload" in plan
    out = tmp_path / "out"
    _cli("optimize", str(folder), str(out), "--budget", budget, "--min-bytes", "0", *dims)
    opt = onnx.load(str(out / "model.onnx"), load_external_data=False)
    prefetched = {a.s.decode() for n in opt.graph.node if n.op_type == "Prefetch"
                  for a in n.attribute if a.name == "name"}
    assert prefetched
    if key.startswith("int4"):  # scales (and zero points) travel with their packed weight
        for n in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node:
            if n.op_type == "MatMulNBits" and n.input[1] in prefetched:
                assert set(n.input[2:]) <= prefetched
    assert "OK (bit-exact)" in _cli("verify", str(folder), str(out), *dims)


def test_one_error_names_every_missing_dim(exports):
    from click.testing import CliRunner

    from ho_onnx.cli import main

    r = CliRunner().invoke(main, ["verify", str(exports["o2"]), str(exports["o2"]),
                                  "--dim", "batch_size=1"])
    assert r.exit_code == 2
    assert "'sequence_length', 'past_sequence_length'" in r.output
    r = CliRunner().invoke(main, ["plan", str(exports["o2"]), "--budget", "1MB",
                                  "--dim", "batch_size=1"])
    assert r.exit_code == 2 and "'sequence_length', 'past_sequence_length'" in r.output
    # A whole shape binds the dims it names.
    r = CliRunner().invoke(main, ["plan", str(exports["o2"]), "--budget", "10MB",
                                  "--shape", "input_ids=1,8", "--dim", "past_sequence_length=4"])
    assert r.exit_code == 0, r.output


def _genai_greedy_apart(folder, max_length: int) -> list[int]:
    """genai_greedy in a child process: genai loads the folder's copy of the op library, which
    must not stay mapped in the test process (tests/test_c_host.py checks the one copy)."""
    import json
    import subprocess
    import sys

    code = ("import json, sys; from models.genai_export import genai_greedy; "
            "print(json.dumps(genai_greedy(sys.argv[1], json.loads(sys.argv[2]), "
            "int(sys.argv[3]))))")
    r = subprocess.run([sys.executable, "-c", code, str(folder), json.dumps(PROMPT),
                        str(max_length)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_greedy_tokens_from_optimized_folders(exports, tmp_path):
    from ho_onnx.target.ort.folders import optimum_session_options

    for key in ("fp32", "int4"):
        out = tmp_path / key
        budget = str(_weight_bytes(exports[key] / "model.onnx") // 2)
        _cli("optimize", str(exports[key]), str(out), "--budget", budget, "--min-bytes", "0",
             *[a for d in GENAI_DIMS for a in ("--dim", d)])
        cfg = (out / "genai_config.json").read_text()
        assert "custom_ops_library" in cfg and "ho_onnx.model_dir" in cfg
        want = genai_greedy(exports[key], PROMPT, max_length=32)
        assert _genai_greedy_apart(out, 32) == want
    out = tmp_path / "o2"
    budget = str(_weight_bytes(exports["o2"] / "model.onnx") // 2)
    _cli("optimize", str(exports["o2"]), str(out), "--budget", budget, "--min-bytes", "0",
         *[a for d in OPTIMUM_DIMS for a in ("--dim", d)])
    want = optimum_greedy(exports["o2"], PROMPT, max_new_tokens=20)
    assert optimum_greedy(out, PROMPT, max_new_tokens=20,
                          session_options=optimum_session_options(out)) == want


def test_kv_cache_in_host_memory_for_both_export_layouts(exports, tmp_path):
    """Issue 36 item 2 on real exports: Optimum's Concat layout and genai's
    GroupQueryAttention (past and present found by structure), the cache and half the
    weights offloaded, one plan over a range of lengths: greedy tokens equal the unmodified
    folder's through ORTModelForCausalLM, the IOBinding loop and genai."""
    from ho_onnx import InferenceSession
    from ho_onnx.target.ort.folders import optimum_session_options
    from ho_onnx.target.ort.generate import greedy, kv_layout

    ranges = {"o2": ["batch_size=1", "sequence_length=1..8", "past_sequence_length=0..40"],
              "fp32": ["batch_size=1", "sequence_length=1..8", "total_sequence_length=1..40",
                       "past_sequence_length=0..40", "kv_cache_dim=16"]}
    for key, dims in ranges.items():
        out = tmp_path / key
        budget = str(_weight_bytes(exports[key] / "model.onnx") // 2)
        said = _cli("optimize", str(exports[key]), str(out), "--budget", budget,
                    "--offload-kv", *[a for d in dims for a in ("--dim", d)])
        layers = 4
        assert f"the KV cache ({2 * layers} past, {2 * layers} present)" in said, said
        ops = _ops(out / "model.onnx")
        assert ops[("ai.hyperoffload", "PrefetchInput")] == ops[("ai.hyperoffload", "Emit")] \
            == 2 * layers
    want = optimum_greedy(exports["o2"], PROMPT, max_new_tokens=20)
    assert optimum_greedy(tmp_path / "o2", PROMPT, max_new_tokens=20,
                          session_options=optimum_session_options(tmp_path / "o2")) == want
    ref = greedy(ort_session(exports["o2"] / "model.onnx"), kv_layout(exports["o2"] /
                                                                      "model.onnx"), PROMPT, 20)
    assert ref == want[len(PROMPT):]
    opt = tmp_path / "o2" / "model.onnx"
    assert greedy(InferenceSession(opt), kv_layout(opt), PROMPT, 20) == ref
    assert _genai_greedy_apart(tmp_path / "fp32", 32) == genai_greedy(exports["fp32"], PROMPT,
                                                                      max_length=32)


def ort_session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def test_decode_cache_with_optimums_loop(exports, tmp_path):
    """Issue 36 item 3 through ORTModelForCausalLM: a range plan of the Optimum export with
    its weights on the disk tier and its KV cache in host memory keeps the weights a decode
    step's room holds across the steps (the library's counters), and generates the
    unmodified folder's tokens."""
    from ho_onnx import counters, reset_counters
    from ho_onnx.target.ort.folders import optimum_session_options

    out = tmp_path / "o2"
    budget = str(_weight_bytes(exports["o2"] / "model.onnx") * 5 // 8)
    said = _cli("optimize", str(exports["o2"]), str(out), "--budget", budget, "--weight-tier",
                "disk", "--offload-kv", "--dim", "batch_size=1", "--dim",
                "sequence_length=1..8", "--dim", "past_sequence_length=0..40", "--point",
                "decode:sequence_length=1,past_sequence_length=40", "--decode-cache")
    assert "decode cache: up to" in said, said
    want = optimum_greedy(exports["o2"], PROMPT, max_new_tokens=20)
    reset_counters()
    assert optimum_greedy(out, PROMPT, max_new_tokens=20,
                          session_options=optimum_session_options(out)) == want
    c = counters()
    assert c["expert_cache_hits"] + c["read_ahead_used"] > 0, c
