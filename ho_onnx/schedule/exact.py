"""The exact planner: CP-SAT (OR-Tools, the ``exact`` extra) over the space of
:mod:`.refine`, its objective the simulator's predicted time.

Variables: per candidate, offloaded or not; per reload, one Prefetch position of its window
(booleans, exactly one when offloaded); per step ``i``, when it may start (``T_i``, before
its Prefetches) and when it starts (``S_i``, after its Waits); per copy, its start and end
(duration × offloaded). Constraints, those of :func:`~ho_onnx.schedule.simulate.simulate`:
``S_i >= T_i`` and ``>=`` the end of each reload waited for at ``i``; ``T_{i+1} >= S_i +
compute_i`` and ``>=`` the end of each store detached after ``i``; a reload starts at or
after ``T`` of its position, the end of the copy before it on its channel (FIFO in reader
order, the space's order) and, for an activation, its store's end; a store starts after its
producer and its channel's previous store; and (redundant, for the solver's bound) a step
starts no earlier than the copies of every reload read by then take back to back. Memory:
per step the unmodified bytes plus each offloaded candidate's change (reloads just in
time) plus each reload's window (from its Prefetch to its reader) within the budget.
Minimising ``T_n`` makes every time its earliest, which is the simulation's; times are
whole units of :data:`UNIT` s (the solver's objective differs from the simulator's time by
rounding only, at most a unit a step and a copy).

Seeded with the refined plan (a hint). What it returns: the best state found, its status
(``optimal`` when proven) and the solver's lower bound on every plan of the space.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .refine import Bound, Space, State

UNIT = 1e-10  # seconds per time unit of the model


@dataclass
class Solved:
    """The exact planner's answer: ``state`` (None: none found), its status, the bound."""

    state: State | None
    status: str
    bound: Bound
    objective_s: float
    seconds: float


def available() -> bool:
    """Whether OR-Tools (the ``exact`` extra) is installed."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def _units(s: float) -> int:
    return round(s / UNIT)


class _Model:
    """The CP-SAT model of one space (module docstring)."""

    def __init__(self, space: Space) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.m = m = cp_model.CpModel()
        self.space = space
        n = len(space.compute_s)
        self.c = [_units(x) for x in space.compute_s.tolist()]
        rel = sum(r.seconds for rs in space.reloads.values() for r in rs)
        self.horizon = h = sum(self.c) + _units(rel + sum(
            s.seconds for s in space.stores.values())) + n + 1
        self.T = [m.new_int_var(0, h, f"T{i}") for i in range(n + 1)]
        self.S = [m.new_int_var(0, h, f"S{i}") for i in range(n)]
        m.add(self.T[0] == 0)
        self.o = {k: m.new_bool_var(f"o:{k}") for k in space.early}
        self.y: dict[tuple[str, int], dict[int, Any]] = {}
        self.end: dict[tuple[str, int], Any] = {}
        self.store_end: dict[str, Any] = {}
        for i in range(n):
            m.add(self.S[i] >= self.T[i])
            m.add(self.T[i + 1] >= self.S[i] + self.c[i])
        self._stores()
        self._reloads()
        self._memory()
        m.minimize(self.T[n])

    def _copy(self, name: str, tag: str, seconds: float, after: Any) -> tuple[Any, Any]:
        """A copy of ``name`` (start, end) that starts after ``after`` (its channel's last
        end), taking ``seconds`` when ``name`` is offloaded, none when not."""
        m, h = self.m, self.horizon
        start, end = m.new_int_var(0, h, f"s:{tag}"), m.new_int_var(0, h, f"e:{tag}")
        if after is not None:
            m.add(start >= after)
        m.add(end == start + _units(seconds) * self.o[name])
        return start, end

    def _stores(self) -> None:
        last: dict[str, Any] = {}
        for name, st in sorted(self.space.stores.items(), key=lambda kv: kv[1].producer):
            start, end = self._copy(name, f"st:{name}", st.seconds, last.get(st.direction))
            self.m.add(start >= self.S[st.producer] + self.c[st.producer])
            self.m.add(self.T[st.last_early + 1] >= end).only_enforce_if(self.o[name])
            last[st.direction] = self.store_end[name] = end

    def _reloads(self) -> None:
        m = self.m
        every = sorted((r for rs in self.space.order.values() for r in rs),
                       key=lambda r: r.event)
        self.rank = {r.key: k for k, r in enumerate(every)}  # the insertion order
        self.ranks = len(every) + 1
        for rs in self.space.order.values():
            prev_end, prev_q = None, None
            for r in rs:
                name = r.key[0]
                ys = {p: m.new_bool_var(f"y:{r.key}:{p}") for p in range(r.lo, r.reader + 1)}
                self.y[r.key] = ys
                m.add(sum(ys.values()) == self.o[name])
                start, end = self._copy(name, f"ld:{r.key}", r.seconds, prev_end)
                for p, y in ys.items():
                    m.add(start >= self.T[p]).only_enforce_if(y)
                if name in self.store_end:
                    m.add(start >= self.store_end[name]).only_enforce_if(self.o[name])
                m.add(self.S[r.reader] >= end).only_enforce_if(self.o[name])
                # FIFO in reader order: q = (issue position, insertion rank) as one number,
                # never decreasing along the channel (free where not offloaded)
                q = m.new_int_var(0, (len(self.S) + 1) * self.ranks, f"q:{r.key}")
                m.add(q == sum(p * self.ranks * y for p, y in ys.items())
                      + self.rank[r.key]).only_enforce_if(self.o[name])
                if prev_q is not None:
                    m.add(q >= prev_q)
                prev_end, prev_q, self.end[r.key] = end, q, end
            # Redundant (tightens the relaxation): a channel moves one copy at a time from
            # 0, so a step starts no earlier than every copy read by then could take.
            busy: list[Any] = []
            for k, r in enumerate(rs):
                busy.append(_units(r.seconds) * self.o[r.key[0]])
                if k + 1 == len(rs) or rs[k + 1].reader != r.reader:
                    m.add(self.S[r.reader] >= sum(busy))

    def _memory(self) -> None:
        sp = self.space
        n = len(sp.compute_s)
        terms: list[list[tuple[int, Any]]] = [[] for _ in range(n)]
        most = sp.start.astype(float).copy()
        for name, ch in sp.change.items():
            for a, b, nbytes in ch:
                for q in range(a, b + 1):
                    terms[q].append((nbytes, self.o[name]))
                    most[q] += max(nbytes, 0)
        for rs in sp.reloads.values():
            for r in rs:
                ys, cover = self.y[r.key], 0
                for q in range(r.lo, r.reader):  # the window: Prefetch at p <= q < reader
                    now = self.m.new_bool_var(f"w:{r.key}:{q}")
                    self.m.add(now == cover + ys[q])
                    terms[q].append((r.nbytes, now))
                    most[q] += r.nbytes
                    cover = now
        for q in range(n):
            if most[q] > sp.budget:
                self.m.add(sum(b * v for b, v in terms[q]) <= int(sp.budget - sp.start[q]))

    def hint(self, s: State) -> None:
        for name, o in self.o.items():
            self.m.add_hint(o, name in s.early)
        for key, ys in self.y.items():
            p = s.positions.get(key) if key[0] in s.early else None
            for q, y in ys.items():
                self.m.add_hint(y, q == p)

    def state(self, solver: Any) -> State:
        out = State({}, {})
        for name, o in self.o.items():
            if solver.boolean_value(o):
                out.early[name] = self.space.early[name]
        for key, ys in self.y.items():
            if key[0] in out.early:
                out.positions[key] = next(p for p, y in ys.items() if solver.boolean_value(y))
        return out


def _completed(space: Space, seed: State, seconds: float, workers: int) -> list[int] | None:
    """Every variable's value in the model of ``space`` with ``seed``'s decisions fixed (its
    times are then propagated), by proto index; None where none is found in ``seconds``."""
    fixed = _Model(space)
    for name, o in fixed.o.items():
        fixed.m.add(o == int(name in seed.early))
    for key, ys in fixed.y.items():
        p = seed.positions.get(key) if key[0] in seed.early else None
        for q, y in ys.items():
            fixed.m.add(y == int(q == p))
    solver = fixed.cp.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, seconds)
    solver.parameters.num_workers = max(1, workers)
    if solver.solve(fixed.m) not in (fixed.cp.OPTIMAL, fixed.cp.FEASIBLE):
        return None
    return [solver.value(fixed.m.get_int_var_from_proto_index(i))
            for i in range(len(fixed.m.proto.variables))]


def solve(space: Space, seed: State | None, seconds: float, workers: int = 2) -> Solved:
    """Solve ``space`` for at most ``seconds`` (module docstring), hinted with ``seed``."""
    import time

    t0 = time.perf_counter()
    model = _Model(space)
    if seed is not None:
        values = _completed(space, seed, seconds / 4, workers)
        if values is None:
            model.hint(seed)
        else:  # every variable hinted: the solver starts from the seed's full solution
            for i, v in enumerate(values):
                model.m.add_hint(model.m.get_int_var_from_proto_index(i), v)
    solver = model.cp.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.1, seconds - (time.perf_counter() - t0))
    solver.parameters.num_workers = max(1, workers)
    code = solver.solve(model.m)
    status = solver.status_name(code).lower()
    # the bound in the model's units, less its rounding (a unit a step and a copy), stays
    # a bound
    rounded = len(space.compute_s) + len(space.stores) + sum(map(len, space.reloads.values()))
    lb = max(0.0, (solver.best_objective_bound - rounded - 1) * UNIT)
    if code not in (model.cp.OPTIMAL, model.cp.FEASIBLE):
        return Solved(None, status, Bound(lb, "exact"), float("nan"),
                      time.perf_counter() - t0)
    return Solved(model.state(solver), status, Bound(lb, "exact"),
                  solver.objective_value * UNIT, time.perf_counter() - t0)
