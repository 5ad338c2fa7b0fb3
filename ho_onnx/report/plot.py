"""A picture of a :class:`~ho_onnx.schedule.planner.Plan`: fast-tier memory and the copy channels.

``plot_timeline(plan, names, path)`` writes one figure (PNG, SVG or PDF, by the suffix):

* **top**: fast-tier bytes over the predicted schedule time, before (baseline, grey) and
  after (planned, blue) the plan, each against its own time axis (stalls shift the planned
  one), the budget as a red dashed line, and the planned schedule's stalls shaded;
* **bottom**: every planned transfer on its copy channel (one lane per direction: ``h2d``,
  ``d2h``, ``disk``) as a bar from its start to its end, coloured by what moves (weight
  reload, activation reload, activation store). A thin line in front of a bar runs from
  the moment the transfer was issued to the moment it started: the FIFO queue (or, for a
  stored activation, its store still running).
  Transfers the compute stream waited for have a red mark under the stalled interval (and,
  up to a few hundred bars per lane, a red edge).

matplotlib is optional (imported on first use, ``Agg`` backend, nothing is shown).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import kinds
from ..errors import HoOnnxError
from ..graph.save import write_atomic
from ..units import binary_unit

if TYPE_CHECKING:
    from ..schedule.planner import Plan
    from ..schedule.simulate import Simulation, TransferEvent

_COLORS = {  # (fill, alternate fill for every other bar on a lane)
    kinds.WEIGHT.name: ("#1f77b4", "#5fa2d6"),
    kinds.ACTIVATION.name: ("#2ca02c", "#72c472"),
    "store": ("#ff7f0e", "#ffb063"),
}
_LABEL_MAX = 24  # transfers labelled with their tensor name up to this many
_EDGE_MAX = 300  # bars get a thin separating edge up to this many per lane


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise HoOnnxError("matplotlib is not installed: pip install matplotlib") from None
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def image_format(path: str | os.PathLike[str]) -> str:
    """The image format ``path``'s suffix names (``png`` without one), or a
    :class:`HoOnnxError` when matplotlib cannot write it (or is missing): checked before any
    work (found by hand: ``--plot t.txt`` was an unexpected ValueError after planning)."""
    _pyplot()  # (matplotlib missing: its error)
    from matplotlib.backend_bases import FigureCanvasBase

    fmt = Path(path).suffix.lstrip(".").lower() or "png"
    formats = FigureCanvasBase.get_supported_filetypes()
    if fmt not in formats:
        raise HoOnnxError(f"cannot plot to {os.fspath(path)!r}: {fmt!r} is no image format "
                          f"matplotlib writes ({', '.join(sorted(formats))})")
    return fmt


def _steps(sim: Simulation) -> tuple[np.ndarray, np.ndarray]:
    """x (ms) and y (bytes) of the memory step line, closed at the run's end."""
    x = np.append(sim.step_start_s, sim.total_s) * 1e3
    y = np.append(sim.memory, sim.memory[-1] if len(sim.memory) else 0)
    return x, y.astype(np.float64)


def _issue_times(sim: Simulation) -> dict[int, float]:
    """When each transfer (by ``id``) was issued on the simulated timeline: a Prefetch
    before step ``i``'s Waits (``step_start_s[i]`` less their stalls), a Store right after
    step ``i``'s compute."""
    waited: dict[int, float] = {}
    for e in sim.transfers:
        if e.kind == "reload":
            waited[e.wait_pos] = waited.get(e.wait_pos, 0.0) + e.stall_s
    out: dict[int, float] = {}
    for e in sim.transfers:
        i = e.issue_pos
        out[id(e)] = float(sim.step_start_s[i] - waited.get(i, 0.0)) if e.kind == "reload" \
            else float(sim.step_start_s[i] + sim.compute_s[i])
    return out


def plot_timeline(plan: Plan, names: list[str], path: str | os.PathLike[str]) -> None:
    """Write the memory/transfer timeline of ``plan`` to ``path`` (module docstring).

    ``names`` are the node names of the analysed order (as for :func:`ho_onnx.report.text.
    format_plan`); they label the peaks. Raises :class:`HoOnnxError` without matplotlib.
    """
    plt = _pyplot()
    base, after = plan.baseline, plan.planned
    budget = plan.budget
    unit, k = binary_unit(max(base.peak_bytes, after.peak_bytes, budget), at_least=4)
    transfers = sorted(after.transfers, key=lambda e: (e.start_s, e.issue_pos))
    act_names = {a.name for a in plan.choice.activations}

    fig, (top, bot) = plt.subplots(
        2, 1, figsize=(13, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    handles = _draw_memory(top, plan, names, unit, k)
    lane_y = _draw_channels(bot, after, transfers, act_names)
    _draw_transfer_labels(bot, plan, transfers, lane_y)
    bot.legend(handles=_channel_legend(transfers, act_names), loc="upper left",
               bbox_to_anchor=(1.0, 1.0), fontsize=7, frameon=False)
    top.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
               frameon=False)
    end = max(base.total_s, after.total_s, max((e.end_s for e in transfers), default=0.0))
    bot.set_xlim(0, end * 1e3 * 1.01 or 1.0)

    slow = after.total_s / base.total_s if base.total_s else 1.0
    fig.suptitle(
        f"peak {base.peak_bytes / k:,.2f} → {after.peak_bytes / k:,.2f} {unit} "
        f"(budget {budget / k:,.2f} {unit})    predicted time {base.total_s * 1e3:,.3f} → "
        f"{after.total_s * 1e3:,.3f} ms (×{slow:.3f}, stall {after.stall_s * 1e3:,.3f} ms)",
        fontsize=11)
    top.set_title(f"{len(names)} steps; offloaded {len(plan.choice.weights)} weights, "
                  f"{len(plan.choice.activations)} activations; {len(transfers)} transfers",
                  fontsize=9, color="#444444")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, dpi=110, format=image_format(path))
    plt.close(fig)
    write_atomic(path, buf.getvalue())


def _draw_memory(top: Any, plan: Plan, names: list[str], unit: str, k: float) -> list[Any]:
    """Top panel: fast-tier memory before and after, the budget, the stalls; the legend
    handles."""
    from matplotlib.patches import Patch

    base, after, budget = plan.baseline, plan.planned, plan.budget
    for sim, color, lw, label in ((base, "#7f7f7f", 1.2, "before"),
                                  (after, "#1f77b4", 1.6, "after")):
        if not len(sim.memory):
            continue
        x, y = _steps(sim)
        top.step(x, y / k, where="post", color=color, lw=lw,
                 label=f"{label}: peak {sim.peak_bytes / k:,.2f} {unit}")
        p = sim.peak_pos
        name = names[p] if p < len(names) else ""
        below = sim is after  # before's label above its line, after's below its line
        top.annotate(f"{label} peak\nstep {p}" + (f": {name[:40]}" if name else ""),
                     (x[p], sim.peak_bytes / k), xytext=(6, -5 if below else 4),
                     textcoords="offset points", fontsize=7, color=color, parse_math=False,
                     va="top" if below else "bottom",
                     bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                           "alpha": 0.75})
    top.axhline(budget / k, color="#d62728", ls="--", lw=1.2,
                label=f"budget {budget / k:,.2f} {unit}")
    stalls = [(e.end_s - e.stall_s, e.stall_s) for e in after.transfers if e.stall_s > 0]
    if stalls:
        top.broken_barh([(s * 1e3, d * 1e3) for s, d in stalls], (0, 1),
                        transform=top.get_xaxis_transform(), color="#d62728",
                        alpha=0.15 if len(stalls) <= _EDGE_MAX else 0.07, lw=0)
    handles, _ = top.get_legend_handles_labels()
    if stalls:
        handles.append(Patch(color="#d62728", alpha=0.25,
                             label=f"stall (after): {after.stall_s * 1e3:,.3f} ms"))
    top.set_ylabel(f"fast-tier memory ({unit})")
    top.set_ylim(0, max(base.peak_bytes, after.peak_bytes, budget) / k * 1.18)
    top.grid(alpha=0.3)
    return handles


def _draw_channels(bot: Any, after: Simulation, transfers: list[TransferEvent],
                   act_names: set[str]) -> dict[str, int]:
    """Bottom panel: one lane per copy channel, a bar per transfer, its queueing and its
    stall; the lane of each channel."""
    lanes = {link.direction: link for link in kinds.links()}  # one per copy direction
    store, load = kinds.stored_links()
    used = [d for d in lanes if any(e.direction == d for e in transfers)] or [
        load.direction, store.direction]
    lane_y = {d: i for i, d in enumerate(reversed(used))}  # first lane on top
    per_lane: dict[str, list[TransferEvent]] = {d: [] for d in used}
    for e in transfers:
        per_lane[e.direction].append(e)
    issue_at = _issue_times(after)
    for d, evs in per_lane.items():
        _draw_lane(bot, lane_y[d], evs, issue_at, act_names)
    bot.set_yticks([lane_y[d] for d in used], [lanes[d].label for d in used], fontsize=8)
    bot.set_ylim(-0.6, len(used) - 0.4)
    bot.set_xlabel("predicted time (ms): before on its own axis, transfers on the planned one")
    bot.set_ylabel("copy channel (FIFO)")
    bot.grid(axis="x", alpha=0.3)
    return lane_y


def _draw_lane(bot: Any, y0: int, evs: list[TransferEvent], issue_at: dict[int, float],
               act_names: set[str]) -> None:
    from matplotlib.collections import LineCollection

    groups: dict[tuple[str, int, bool], list[tuple[float, float]]] = {}
    queue: list[list[tuple[float, float]]] = []
    marks: list[list[tuple[float, float]]] = []
    for j, e in enumerate(evs):
        what = "store" if e.kind == "store" else (
            kinds.ACTIVATION.name if e.tensor in act_names else kinds.WEIGHT.name)
        dur = max(e.end_s - e.start_s, 0.0)
        groups.setdefault((what, j % 2, e.stall_s > 0), []).append((e.start_s * 1e3, dur * 1e3))
        issued = issue_at[id(e)]
        if e.start_s - issued > 1e-12:  # waited in the FIFO queue
            qy = y0 + 0.22 + 0.18 * ((j % 5) / 4)
            queue.append([(issued * 1e3, qy), (e.start_s * 1e3, qy)])
        if e.stall_s > 0:
            marks.append([((e.end_s - e.stall_s) * 1e3, y0 - 0.36), (e.end_s * 1e3, y0 - 0.36)])
    many = len(evs) > _EDGE_MAX
    for (what, alt, stalled), spans in groups.items():
        fill = _COLORS[what][alt]
        if many:  # edges would hide the fills: stalls show by their red marks only
            edge, lw = fill, 0.0
        elif stalled:
            edge, lw = "#d62728", 1.0
        else:
            edge, lw = "white", 0.4
        bot.broken_barh(spans, (y0 - 0.3, 0.5), facecolors=fill, edgecolors=edge, linewidths=lw)
    if queue:
        bot.add_collection(LineCollection(queue, colors="#333333", linewidths=0.9, alpha=0.7))
    if marks:
        bot.add_collection(LineCollection(marks, colors="#d62728", linewidths=2.5))


def _draw_transfer_labels(bot: Any, plan: Plan, transfers: list[TransferEvent],
                          lane_y: dict[str, int]) -> None:
    if transfers and len(transfers) <= _LABEL_MAX:
        span = max(plan.planned.total_s, plan.baseline.total_s, transfers[-1].end_s) or 1.0
        for e in transfers:
            wide = (e.end_s - e.start_s) / span > 0.12  # room for the name across the bar
            label = e.tensor if len(e.tensor) <= 24 else "…" + e.tensor[-23:]
            bot.text(max((e.start_s + e.end_s) / 2, 0.0) * 1e3, lane_y[e.direction] - 0.05,
                     label, ha="center", va="center", fontsize=6,
                     rotation=0 if wide else 90, clip_on=True,
                     parse_math=False)  # (a name is text: "$\\bogus$" was a ValueError)
    if not transfers:
        bot.text(0.5, 0.5, "no transfers: the model fits the budget", ha="center",
                 va="center", transform=bot.transAxes, fontsize=10, color="#555555")


def _channel_legend(transfers: list[TransferEvent], act_names: set[str]) -> list[Any]:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n_w = sum(1 for e in transfers if e.kind == "reload" and e.tensor not in act_names)
    n_a = sum(1 for e in transfers if e.kind == "reload" and e.tensor in act_names)
    n_s = sum(1 for e in transfers if e.kind == "store")
    n_stall = sum(1 for e in transfers if e.stall_s > 0)
    return [Patch(color=_COLORS[kinds.WEIGHT.name][0], label=f"weight reload ({n_w})"),
            Patch(color=_COLORS[kinds.ACTIVATION.name][0],
                  label=f"activation reload ({n_a})"),
            Patch(color=_COLORS["store"][0], label=f"activation store ({n_s})"),
            Patch(facecolor="white", edgecolor="#d62728",
                  label=f"compute waited ({n_stall}; red mark: the stall)"),
            Line2D([], [], color="#333333", lw=0.9, label="queued (issued → started)")]
