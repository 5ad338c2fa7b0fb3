"""The tier and kind registries (ho_onnx.kinds, issue 35): host/disk and weight/activation
are entries, and a further tier or kind registered there is picked up by the options, the
deciders, the simulation, the insertion pass and the reports without other code changes
(each assertion on a fake entry below fails where a string comparison remains on its path:
``"disk" if tier == "disk" else "h2d"`` sends a third tier down the host path)."""

from __future__ import annotations

import json

import onnx
import pytest
from click.testing import CliRunner

from cli import main
from ho_onnx import OffloadOptions, kinds, optimize
from ho_onnx.contract import ATTR_TIER, DOMAIN, PREFETCH
from ho_onnx.cost.machine import load_machine, transfer_time
from ho_onnx.cost.model import CostModel
from ho_onnx.graph.analyse import analyse
from ho_onnx.report.inspect import summarize
from ho_onnx.rewrite.insert import channel_of_tier, prefetch_channel
from ho_onnx.schedule.lifetimes import host_bytes
from ho_onnx.schedule.planner import plan
from ho_onnx.schedule.policy import choose
from ho_onnx.schedule.simulate import simulate
from ho_onnx.schedule.types import OffloadChoice, WeightOffload
from tests.graphs import chain_model, save

# A third tier: a network store read on a channel of its own, at the disk's bandwidth.
REMOTE = kinds.StorageTier("remote", 2, kinds.Link("remote", "disk_bw", "remote\n(net)"),
                           "remote", in_host_memory=False)


@pytest.fixture
def remote():
    with kinds.registered(REMOTE) as t:
        yield t


def test_host_and_disk_are_the_registered_tiers():
    assert kinds.tier_names() == ("host", "disk")
    assert kinds.default_tier() is kinds.HOST and kinds.spill_tier(kinds.HOST) is kinds.DISK
    assert [link.direction for link in kinds.links()] == ["h2d", "d2h", "disk"]
    assert dict(kinds.bandwidths()) == {"h2d": "h2d_bw", "d2h": "d2h_bw", "disk": "disk_bw"}
    assert kinds.host_loads() == {"h2d"}
    # what a Prefetch's attribute means: absent (or a word no tier has) is the default
    assert [kinds.tier_of_attribute(v).name for v in (None, "disk", "host", "flash", 3)] == [
        "host", "disk", "host", "host", "host"]
    assert (channel_of_tier("disk"), channel_of_tier("host"), channel_of_tier(None)) == (
        "disk", "load", "load")
    with pytest.raises(ValueError, match=r"tier must be host\|disk, not 'flash'"):
        kinds.tier("flash")


def test_a_tier_is_registered_once_and_the_default_stays():
    with pytest.raises(ValueError, match="registered already"):
        kinds.register_tier(kinds.StorageTier("disk", 9, kinds.DISK_READ, "x", False))
    with pytest.raises(ValueError, match="registered already"):  # a rank is one place
        kinds.register_tier(kinds.StorageTier("other", 1, kinds.DISK_READ, "x", False))
    with pytest.raises(ValueError, match="default tier"):
        kinds.unregister_tier("host")
    assert kinds.tier_names() == ("host", "disk")


def test_a_registered_tier_is_accepted_as_an_option_and_goes_away_again(remote):
    assert kinds.tier_names() == ("host", "disk", "remote")
    assert kinds.spill_tier(kinds.HOST) is kinds.DISK  # the next tier out of host memory
    assert OffloadOptions(weight_tier="remote").weight_tier == "remote"
    kinds.unregister_tier("remote")
    with pytest.raises(ValueError, match=r"weight_tier must be host\|disk, not 'remote'"):
        OffloadOptions(weight_tier="remote")
    kinds.register_tier(REMOTE)  # (the fixture unregisters it)


def test_a_third_tier_reaches_the_cost_model_and_the_simulation(remote):
    machine = load_machine("h100")
    assert transfer_time(machine, 1 << 20, "remote") == transfer_time(machine, 1 << 20, "disk")
    a = analyse(chain_model(), {"N": 4})
    choice = choose(a, OffloadOptions(activations=False, min_bytes=0, weight_tier="remote"),
                    {"N": 4})
    assert {w.tier for w in choice.weights} == {"remote"} and choice.weights
    costs = CostModel([1e-3] * len(a.order), machine.transfer_time)
    sim = simulate(a, choice, costs.compute_s, costs.transfer_time, {"N": 4})
    assert {e.direction for e in sim.transfers} == {"remote"}
    assert host_bytes(choice) == 0  # not in host memory


def test_a_tier_in_host_memory_counts_in_host_bytes():
    pinned = kinds.StorageTier("pinned", 3, kinds.H2D, "load", in_host_memory=True)
    with kinds.registered(pinned):
        w = WeightOffload("W", 100, (1,), (0,), tier="pinned")
        assert host_bytes(OffloadChoice(weights=[w])) == 100
    with pytest.raises(ValueError, match=r"tier must be host\|disk, not \'pinned\'"):
        WeightOffload("W", 100, (1,), (0,), tier="pinned")


def test_the_planner_places_reloads_of_a_third_tier_on_its_channel(tmp_path, remote):
    a = analyse(chain_model(), {"N": 64})
    costs = CostModel([1e-3] * len(a.order), load_machine("h100").transfer_time)
    opts = OffloadOptions(activations=False, min_bytes=0, weight_tier="remote", budget=1)
    with pytest.raises(Exception, match="budget"):  # the smallest budget is named
        plan(a, opts, costs, {"N": 64})
    base = plan(a, OffloadOptions(activations=False, min_bytes=0, weight_tier="remote",
                                  budget=1 << 30), costs, {"N": 64}).baseline.peak_bytes
    p = plan(a, OffloadOptions(activations=False, min_bytes=0, weight_tier="remote",
                               budget=base - 1), costs, {"N": 64})
    assert p.choice.weights and {w.tier for w in p.choice.weights} == {"remote"}
    assert {e.direction for e in p.planned.transfers} == {"remote"}
    pytest.importorskip("matplotlib")
    from ho_onnx.report.plot import plot_timeline

    plot_timeline(p, [n.name for n in a.nodes], tmp_path / "t.png")  # a lane of its own
    assert (tmp_path / "t.png").stat().st_size > 0


def test_a_third_tier_reaches_the_rewritten_model_and_the_reports(tmp_path, remote):
    src = save(chain_model(), tmp_path / "m.onnx", external=True)
    out = tmp_path / "m.ho.onnx"
    optimize(src, out, OffloadOptions(activations=False, min_bytes=0, weight_tier="remote"),
             dims={"N": 4})
    m = onnx.load(out, load_external_data=False)
    pfs = [n for n in m.graph.node if n.domain == DOMAIN and n.op_type == PREFETCH]
    assert len(pfs) == 2
    assert all({a.name: a.s.decode() for a in p.attribute if a.type == onnx.AttributeProto.STRING
                }[ATTR_TIER] == "remote" for p in pfs)
    assert {prefetch_channel(p) for p in pfs} == {"remote"}
    assert {(t.kind, t.tier) for t in summarize(out).transfers} == {("weight", "remote")}
    r = CliRunner().invoke(main, ["inspect", str(out), "--json"])
    assert {t["tier"] for t in json.loads(r.stdout)["transfers"]} == {"remote"}


def test_weight_and_activation_are_the_registered_kinds():
    assert [k.name for k in kinds.kinds()] == ["kv", "weight", "activation"]
    assert [k.name for k in kinds.kinds() if not k.fixed] == ["weight", "activation"]
    assert kinds.WEIGHT.ops == ("Prefetch", "Wait")
    assert kinds.ACTIVATION.ops == ("Store", "Detach", "Prefetch", "Wait")
    assert kinds.KV.ops == ("PrefetchInput", "Wait", "Emit")
    a = analyse(chain_model(), {"N": 4})
    got = {n: k.name if (k := kinds.kind_of(t)) else None for n, t in a.tensors.items()}
    assert (got["W1"], got["h1"], got["x"]) == ("weight", "activation", None)
    with pytest.raises(ValueError, match=r"kind must be weight\|activation\|kv, not \'expert\'"):
        kinds.kind("expert")


# A kind matched before the general weight: initializers named like MoE experts.
EXPERT = kinds.TensorKind("expert", "weights", stored=False, priority=1,
                          matches=lambda t: t.is_initializer and t.name.startswith("W2"))


def test_a_registered_kind_is_matched_first_and_moves_like_its_pattern():
    a = analyse(chain_model(), {"N": 64})
    with kinds.registered(EXPERT):
        assert kinds.kind_of(a.tensors["W2"]) is EXPERT
        assert kinds.kind_of(a.tensors["W1"]) is kinds.WEIGHT
        choice = choose(a, OffloadOptions(activations=False, min_bytes=0), {"N": 64})
        assert {w.name for w in choice.weights} == {"W1", "W2"}  # both reloaded per reader
        costs = CostModel([1e-3] * len(a.order), load_machine("h100").transfer_time)
        base = plan(a, OffloadOptions(activations=False, min_bytes=0, budget=1 << 30), costs,
                    {"N": 64}).baseline.peak_bytes
        p = plan(a, OffloadOptions(activations=False, min_bytes=0, budget=base - 1), costs,
                 {"N": 64})
        assert p.choice.weights
    assert [k.name for k in kinds.kinds()] == ["kv", "weight", "activation"]


def test_a_kind_whose_option_the_options_lack_is_never_offloaded():
    kv = kinds.TensorKind("kv_cache", "kv_cache", stored=True, priority=1,
                          matches=lambda t: t.name == "h1")
    a = analyse(chain_model(), {"N": 4})
    with kinds.registered(kv):
        choice = choose(a, OffloadOptions(min_bytes=0, min_gap=1), {"N": 4})
    assert "h1" not in {x.name for x in choice.activations}
    assert "h1" in {x.name for x in choose(a, OffloadOptions(min_bytes=0, min_gap=1),
                                           {"N": 4}).activations}
