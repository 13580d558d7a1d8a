"""Long horizons: the plan of levels and meshes, and the composition level by level.

Item 3 of :mod:`~opacus_rc.accountants.analysis.compose`'s docstring: ``sum_j counts[j]`` steps
are composed in blocks of ``branching`` units, blocks of blocks likewise (``levels``), each
level re-discretised on the mesh ``h_l = h_0 sqrt(branching^l)`` so that every level adds the
same share of the error budget (``nu2``, item 4). :func:`choose_plan` picks the fewest levels
whose largest FFT fits; :func:`compose_levels` runs the plan.

Pure numpy; no Opacus import.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from opacus_rc.accountants.analysis import discrete
from opacus_rc.accountants.analysis.discrete import (
    WINDOW_TAIL,
    MgfBound,
    StepMgf,
    TiltedPmf,
    chernoff_window,
    coarsen,
    product,
)

__all__ = ["MAX_LEVELS", "Plan", "choose_plan", "compose_levels", "digits", "nu2_ratio"]

#: Most levels of blocks (item 3 of the composition's docstring).
MAX_LEVELS = 3


@dataclass(frozen=True)
class Plan:
    """Levels, units per block and meshes of one composition (:func:`choose_plan`)."""

    levels: int
    branching: int
    mesh0: float
    meshes: tuple[float, ...]  # h_0, ..., h_L
    nu2_over_h0: float


def digits(n: int, branching: int, levels: int) -> list[int]:
    """``n = sum_l d_l branching^l`` with ``d_l < branching`` for ``l < levels``."""
    out = []
    for _ in range(levels):
        out.append(n % branching)
        n //= branching
    out.append(n)
    return out


def nu2_ratio(counts: Sequence[int], branching: int, levels: int) -> float:
    """``nu2 / h_0^2`` of :func:`compose_levels` with ``h_l^2 = branching^l h_0^2``."""
    if levels == 0:
        return float(sum(counts))
    unit = [1.0]  # nu2(unit_l) / h_0^2
    for lv in range(1, levels + 1):
        unit.append(branching * unit[-1] + branching**lv)
    total = 0.0
    for n in counts:
        d = digits(int(n), branching, levels)
        partial = 0.0
        for lv in range(1, levels + 1):
            if d[lv - 1] or partial:
                partial = d[lv - 1] * unit[lv - 1] + partial + branching**lv
        total += d[levels] * unit[levels] + partial
    return total


def _width(mgfs: Sequence[StepMgf], counts: Sequence[float], lam: float) -> float:
    lo, hi = chernoff_window(MgfBound(tuple(counts)), mgfs, lam, -math.log(WINDOW_TAIL))
    return hi - lo


def choose_plan(
    counts: Sequence[int],
    spans: Sequence[float],
    mgfs: Sequence[StepMgf],
    eps_error: float,
    log_beta: float,
    lam: float,
) -> tuple[Plan, float]:
    """The fewest levels whose largest FFT fits, else the one with the smallest largest FFT.

    Returns the plan and its estimated largest FFT length.
    """
    n_max = max(counts)
    best = None
    for levels in range(MAX_LEVELS + 1):
        branching = max(2, int(math.ceil(n_max ** (1.0 / (levels + 1)) - 1e-9)))
        if levels and branching**levels > n_max:
            break
        ratio = nu2_ratio(counts, branching, levels)
        h0 = eps_error / math.sqrt(ratio * log_beta / 2.0)
        meshes = tuple(h0 * math.sqrt(branching**lv) for lv in range(levels + 1))
        points = max(spans) / h0
        for lv in range(levels):  # the products that build the units of level lv + 1
            for j, n in enumerate(counts):
                vec = [0.0] * len(counts)
                vec[j] = float(min(branching ** (lv + 1), n))
                points = max(points, _width(mgfs, vec, lam) / meshes[lv])
        points = max(points, _width(mgfs, [float(n) for n in counts], lam) / meshes[-1])
        plan = Plan(levels, branching, h0, meshes, ratio)
        if points <= discrete.MAX_FFT_POINTS / 2:
            return plan, points
        if best is None or points < best[1]:
            best = (plan, points)
    return best


def compose_levels(
    steps: Sequence[TiltedPmf],
    counts: Sequence[int],
    plan: Plan,
    mgfs: Sequence[StepMgf],
    log_tail: float,
) -> TiltedPmf:
    """``sum_j counts[j]`` steps composed level by level (item 3 of
    :mod:`~opacus_rc.accountants.analysis.compose`).

    Per segment, with ``n = sum_l d_l b^l``: ``unit_l = coarsen(unit_{l-1}^{*b}, h_l)`` and
    ``partial_l = coarsen(unit_{l-1}^{*d_{l-1}} * partial_{l-1}, h_l)``; the result is
    ``prod_j unit_L^{*d_L} * partial_L`` on the mesh ``h_L``.
    """
    tops: list[tuple[TiltedPmf, int]] = []
    for step, n in zip(steps, counts):
        if plan.levels == 0:
            tops.append((step, n))
            continue
        d = digits(int(n), plan.branching, plan.levels)
        unit, partial = step, None
        for lv in range(1, plan.levels + 1):
            parts = [(unit, d[lv - 1])] if d[lv - 1] else []
            if partial is not None:
                parts.append((partial, 1))
            if parts:
                partial = coarsen(product(parts, mgfs, log_tail), plan.meshes[lv])
            if n >= plan.branching**lv:
                unit = coarsen(product([(unit, plan.branching)], mgfs, log_tail), plan.meshes[lv])
        if d[plan.levels]:
            tops.append((unit, d[plan.levels]))
        if partial is not None:
            tops.append((partial, 1))
    return product(tops, mgfs, log_tail)
