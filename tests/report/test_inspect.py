"""``ho-onnx inspect``: transfers of an optimized model and the CUDA placement verdict."""

from __future__ import annotations

import onnx
import onnx.parser
from click.testing import CliRunner

from cli import main
from ho_onnx import OffloadOptions, contract, optimize
from ho_onnx.report.inspect import summarize
from models.decoder import build_decoder

SPLIT = """<ir_version: 9, opset_import: ["" : 17, "ai.hyperoffload" : 1]>
g (float[4, 4] x) => (float[4, 4] out)
<float[0] src0 = {}> {
  r = Relu (x)
  s = Shape (x)
  y = ai.hyperoffload.Prefetch <location: string = "w.bin", offset: int = 0, length: int = 64,
                                name: string = "W", shape: ints = [4, 4]> (src0, s)
  z = ai.hyperoffload.Wait (y, r)
  out = MatMul (r, z)
}"""


def test_inspect_reports_every_chain_on_cuda_for_an_optimized_decoder(tmp_path):
    src = tmp_path / "d.onnx"
    build_decoder(src, layers=1, hidden=32, heads=2, external_data=True)
    out = tmp_path / "d.ho.onnx"
    optimize(src, out, OffloadOptions(min_bytes=0, min_gap=1), dims={"batch": 1, "seq": 4})
    s = summarize(out)
    # on the CPU only: the ops registered for it alone (the embedding's GatherRows)
    cpu_only = sum(n.op_type in contract.CPU_ONLY
                   for n in onnx.load(str(out), load_external_data=False).graph.node)
    assert s.split_chains == [] and s.cuda_placement.get("CPU", 0) == cpu_only
    assert s.cuda_placement["CUDA"] > cpu_only
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "every chain on one provider" in r.output


def test_inspect_names_a_split_chain(tmp_path):
    m = onnx.parser.parse_model(SPLIT)
    for i, n in enumerate(m.graph.node):
        n.name = f"n{i}"
    p = tmp_path / "split.onnx"
    onnx.save(m, p)
    s = summarize(p)
    assert s.cuda_placement == {"CPU": 1, "CUDA": 1}
    assert len(s.split_chains) == 1 and "W: Prefetch 'n2' on CPU" in s.split_chains[0]
    r = CliRunner().invoke(main, ["inspect", str(p)])
    assert "1 SPLIT chain(s)" in r.output and "split: W" in r.output


def test_inspect_reads_a_length_of_the_wrong_type_as_unknown(tmp_path):
    """A model carries whatever attribute types it likes (found by the fuzzer: a string
    ``length`` was an unexpected ValueError): the bytes are unknown, the rest is listed."""
    p = tmp_path / "m.onnx"
    onnx.save(onnx.parser.parse_model(SPLIT.replace("length: int = 64", 'length: string = "x"')),
              p)
    (t,) = summarize(p).transfers
    assert (t.tensor, t.kind, t.nbytes, t.source) == ("W", "weight", None, "w.bin@0")
    r = CliRunner().invoke(main, ["inspect", str(p)])
    assert r.exit_code == 0, r.output
    assert "1 transfers per run" in r.output


ACTIVATION = """<ir_version: 9, opset_import: ["" : 17, "ai.hyperoffload" : 1]>
g (float[4] x) => (float[4] out)
{
  r = Relu (x)
  t = ai.hyperoffload.Detach (r)
  y = ai.hyperoffload.Prefetch (t)
  out = ai.hyperoffload.Wait (y, r)
}"""


def test_inspect_reads_an_absurd_activation_size_as_unknown(tmp_path):
    """An activation Prefetch whose output claims 300 dims of 2**62 (found by the fuzzer:
    its ~5,600-digit byte count was an unexpected ValueError in --json and the table):
    its bytes are unknown."""
    m = onnx.parser.parse_model(ACTIVATION)
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2**62] * 300)
    m.graph.value_info.append(y)
    p = tmp_path / "m.onnx"
    onnx.save(m, p)
    (t,) = summarize(p).transfers
    assert (t.kind, t.nbytes) == ("activation", None)
    for args in ([str(p)], [str(p), "--json"]):
        r = CliRunner().invoke(main, ["inspect", *args])
        assert r.exit_code == 0, r.output



def test_inspect_says_each_transfer_tier(tmp_path):
    """Weights read from disk at every Prefetch are told apart from the host store's (the
    table did not say), in the table and the JSON."""
    import json

    src = tmp_path / "d.onnx"
    build_decoder(src, layers=1, hidden=32, heads=2, external_data=True)
    dims = {"batch": 1, "seq": 4}
    for tier in ("host", "disk"):
        out = tmp_path / f"{tier}.ho.onnx"
        optimize(src, out, OffloadOptions(min_bytes=0, min_gap=1, weight_tier=tier), dims=dims)
        s = summarize(out)
        kinds = {(t.kind, t.tier) for t in s.transfers}
        assert kinds == {("weight", tier), ("activation", "host")}, kinds
        r = CliRunner().invoke(main, ["inspect", str(out)])
        rows = [ln.split() for ln in r.output.splitlines() if " weight " in ln]
        assert rows and all(row[2] == tier for row in rows), r.output
        r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
        tiers = {t["tier"] for t in json.loads(r.stdout)["transfers"] if t["kind"] == "weight"}
        assert tiers == {tier}


def test_inspect_lists_the_transfers_of_a_loop_body_per_iteration(tmp_path):
    """A body planned per iteration: its cache ops are counted (and named by their
    subgraph), its transfers listed with their graph and marked per iteration, and the
    per-run total leaves them out (they move at every iteration)."""
    from graphs import LOOP_LAYERS, LOOP_N, text_model

    n = LOOP_N
    src = tmp_path / "layers.onnx"
    onnx.save(text_model(LOOP_LAYERS, **{f"W{k}": (n, n) for k in range(6)}), str(src))
    out = tmp_path / "o" / "m.onnx"
    optimize(src, out, OffloadOptions(budget=8 * n * n * 4, min_bytes=0, activations=False))
    body = next(x for x in onnx.load(str(out), load_external_data=False).graph.node
                if x.op_type == "Loop").attribute[0].g
    ops = sum(x.domain == contract.DOMAIN for x in body.node)
    s = summarize(out)
    assert s.subgraph_cache_ops == {"Loop '<unnamed>' body": ops}
    assert s.cache_ops["Prefetch"] >= 1 and sum(s.cache_ops.values()) >= ops
    looped = [t for t in s.transfers if t.per_iteration]
    assert looped and {t.graph for t in looped} == {"Loop '<unnamed>' body"}
    assert {t.tensor for t in looped} <= {"W1", "W2", "W3", "W4"}
    r = CliRunner().invoke(main, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert f"{len(looped)} more at every iteration of a Loop/Scan body " \
           f"({len(looped) * n * n * 4:,} bytes an iteration)" in r.output
    assert "[Loop '<unnamed>' body, every iteration]" in r.output
