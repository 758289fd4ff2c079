"""`jbench sweep --search GOAL`: measure only what can change the answer (docs/advise.md, "Searching").

The experiment's grid is planned as for a full sweep; the search then chooses, one at a time, which of its trials to
run, through the normal sweep path (one sweep run with its trial runs, power states applied and restored, resume:
an interrupted search run again asks the same questions, whose answers are already FINISHED). It ends with the
advisor's answer over the trials it measured (jbench.analysis.advice).

**The optimiser**: Optuna's TPE sampler over the grid's dimensions as categorical parameters (power mode, quant,
KV type and backend are categories, not numbers; TPE models each category's density, where a Gaussian process needs
an embedding), with constraints: each measured configuration tells its objective and one violation per constraint
(`Trial.set_constraint`: bound − value for `>=`, value − bound for `<=`, scaled by the bound; <= 0 is feasible), so
TPE draws from the feasible good region. A suggestion the grid does not hold (a cell dropped by the experiment's rules) is told
as failed; a suggestion already measured is told its measured value again; after 50 such asks in a row an
unmeasured cell is enqueued at random (the seed's), so the search always makes progress. A FAILED trial (out of
memory, a crash) is told as failed: TPE learns to avoid its region.

**Before anything runs** (`pruned`), cheap predictions rule out cells that cannot meet a constraint: a
`decode_tps >= X` constraint against the decode ceiling from the datasheet bandwidth of the device's profile and the
model file's bytes per token (weights + KV at the trial's depth: decode cannot beat reading them once per token). The
same ceiling bounds a decode_tps objective: when no cell left unmeasured can beat the incumbent's measured mean,
the search stops ("no candidate can beat the incumbent").

**Repetitions adapt to the noise**: a configuration is measured again (another run of it: the trial as the unit of
noise), up to `max_runs`, while its probability of meeting the constraints is between 1 − confidence and confidence
(as soon as it is measured), or, once the search settles (its local phase), while it is one of the LEADERS best
feasible ones and its objective is not significantly different from the incumbent's (Welch at alpha): the near-ties
that decide the answer, not every configuration on the way. A configuration clearly feasible and clearly worse, or
clearly infeasible, is not measured again. A figure measured once with no spread of its own (a memory pass runs once per trial) is judged with the pooled relative
run-to-run spread of the configurations measured more than once, and on its value alone (as the advisor judges it)
before there is any: noise differs from point to point, and each point's own spread is used where it was measured.

**Then local**: with a trial budget, after GLOBAL_SHARE of it (or, without one, after `patience` new configurations
without a better feasible one), the search measures the cells around the LEADERS best feasible configurations (one
dimension changed, then two), the most promising first by a ridge regression on the measurements (each dimension
value's effect and each pair of values' interaction). TPE finds the good region; the best is often a near-tie inside
it that a step of one dimension reaches, and whose value comes from a pair (flash attention with a quantized K cache)
that an additive model misses (docs/PERFORMANCE.md, "The search against a replayed grid").

**Stops** at the trial budget (runs measured), the time budget, when every cell was measured or ruled out, when no
cell can beat the incumbent (above), or, without a trial budget, when the cells around the leaders are measured after
`patience` configurations without a better feasible one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

from jbench.analysis.advice import Estimate, Goal, MEETS, UNDECIDED, _welch_p
from jbench.core.trial import ChoosesKVTypes, FixedLengths, Trial

log = logging.getLogger("jbench.search")

# With a trial budget, the share of it TPE spends over the whole grid before the local phase (the incumbent's
# neighbours). On the 144-cell grid of docs/PERFORMANCE.md, TPE alone found the best in 28 of 40 seeds at a 25 % budget.
GLOBAL_SHARE = 0.67
LEADERS = 3  # the local phase looks around the best this many feasible configurations (near-ties swap under noise)
# The local model's ridge penalties (on the standardised objective): pairs of values shrink more than single values.
# On the replayed 144-cell grid any of 0.1..1 and 0.5..3 found the best in 93-94 of 100 seeds.
RIDGE_MAIN, RIDGE_PAIR = 0.5, 2.0
MAX_ASKS = 50  # asks in a row that hit a measured or missing cell before an unmeasured one is enqueued


@dataclasses.dataclass
class SearchSettings:
    budget_trials: Optional[int] = None  # runs measured at most (repeats included)
    budget_s: Optional[float] = None
    max_runs: int = 2  # runs of one configuration at most (adaptive repetitions)
    patience: Optional[int] = None  # new configurations without a better feasible one; None: a third of the grid
    seed: int = 0

    def problems(self) -> list[str]:
        out = []
        if self.budget_trials is not None and self.budget_trials < 1:
            out.append(f"--budget-trials {self.budget_trials}: give at least 1")
        if self.budget_s is not None and self.budget_s <= 0:
            out.append(f"--budget-time {self.budget_s}: give a positive number of seconds")
        if self.max_runs < 1:
            out.append(f"--max-runs {self.max_runs}: give at least 1")
        if self.patience is not None and self.patience < 1:
            out.append(f"--patience {self.patience}: give at least 1")
        return out


@dataclasses.dataclass
class Measured:
    """What the search knows of one configuration: each run's metrics (FINISHED runs), failed runs."""

    trial: Trial
    runs: list[dict[str, float]] = dataclasses.field(default_factory=list)
    failed: int = 0

    def estimate(self, metric: str, pooled_cv: Optional[float] = None) -> Estimate:
        """The configuration's estimate (as the advisor's, from the outcomes seen); one value without a spread of its
        own borrows `pooled_cv` (the relative run-to-run spread of the configurations measured more than once)."""
        values = [float(r[metric]) for r in self.runs if metric in r and math.isfinite(float(r[metric]))]
        if not values:
            return Estimate(math.nan, math.nan, math.nan, 0, "missing")
        mean = sum(values) / len(values)
        if len(values) >= 2:
            sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
            return Estimate(mean, sd / math.sqrt(len(values)), len(values) - 1, len(values), "runs")
        # One run: its repetitions' spread where the trial recorded one (`<phase>_tps_std`, `<phase>_repetitions`).
        run = self.runs[-1]
        std, reps, err = run.get(f"{metric}_std"), run.get(_reps_key(metric)), run.get(f"{metric}_err")
        if std is not None and math.isfinite(std) and reps is not None and reps >= 2:
            n = int(reps)
            return Estimate(mean, std / math.sqrt(n), n - 1, n, "repetitions (one trial)")
        if err is not None and math.isfinite(err):
            return Estimate(mean, err, math.inf, 1, "tool error")
        if pooled_cv is not None:
            return Estimate(mean, pooled_cv * abs(mean), math.inf, 1, "one value, pooled noise")
        return Estimate(mean, math.nan, math.nan, 1, "one value")


def _reps_key(metric: str) -> str:
    """decode_tps -> decode_repetitions (the speed metrics' repetition count)."""
    return f"{metric.split('_', 1)[0]}_repetitions"


def violations(goal: Goal, m: Measured) -> list[float]:
    """One value per constraint, <= 0 when met by the configuration's mean (scaled by the bound)."""
    out = []
    for c in goal.constraints:
        e = m.estimate(c.metric)
        if not e.known:
            out.append(1.0)  # not recorded: treated as violated
            continue
        scale = abs(c.bound) or 1.0
        out.append((c.bound - e.mean) / scale if c.sense > 0 else (e.mean - c.bound) / scale)
    return out


def verdict(goal: Goal, m: Measured,
            cv: Callable[[str], Optional[float]] = lambda metric: None) -> tuple[str, float]:
    """(meets | fails | undecided, joint probability) of a configuration from its runs so far. A value without a
    spread of its own takes the pooled relative noise `cv(metric)`; with none known (None) it is judged on the value
    alone, as the advisor judges it."""
    joint, undecided = 1.0, False
    for c in goal.constraints:
        e = m.estimate(c.metric, cv(c.metric))
        if not e.known:
            return UNDECIDED, math.nan
        p_up = e.prob_at_least(c.bound)
        if not math.isfinite(p_up):
            p_up = 1.0 if e.mean >= c.bound else 0.0
        p = p_up if c.sense > 0 else 1.0 - p_up
        if p < 1 - goal.confidence:
            return "fails", p
        if p < goal.confidence:
            undecided = True
        joint *= p
    if undecided or joint < goal.confidence:
        return UNDECIDED, joint
    return MEETS, joint


class Search:
    """The trial order of a `sweep --search`: `order(trials)` yields the trials to run (the sweep runs each and calls
    `observe` with its outcome before asking for the next)."""

    def __init__(self, goal: Goal, settings: SearchSettings, *, dims: dict[str, list],
                 upper_bound: Optional[Callable[[Trial, str], Optional[float]]] = None,
                 earlier_metrics: Optional[Callable[[str], dict[str, float]]] = None):
        self.goal, self.settings, self.dims = goal, settings, dims
        self.upper_bound = upper_bound or (lambda trial, metric: None)
        self.earlier_metrics = earlier_metrics or (lambda run_id: {})
        self.measured: dict[str, Measured] = {}  # config hash -> what is known
        self.pruned: list[tuple[Trial, str]] = []
        self.stop_reason = ""
        self.runs = 0
        self._last: Optional[Trial] = None

    # -- the sweep's hooks ----------------------------------------------------------------------------

    def observe(self, outcome: Any) -> None:
        """A trial's outcome (jbench.runner.trials.TrialOutcome): FINISHED (or FINISHED earlier: resumed) -> its
        metrics; anything else -> a failed run."""
        trial = outcome.trial
        m = self.measured.setdefault(trial.config_hash, Measured(trial))
        status = getattr(outcome.status, "value", str(outcome.status))
        metrics = dict(outcome.metrics or {})
        if not metrics and outcome.earlier_run_id:
            metrics = dict(self.earlier_metrics(outcome.earlier_run_id) or {})
        if status in ("FINISHED",) or (status == "SKIPPED" and metrics):
            m.runs.append(metrics)
        else:
            m.failed += 1

    # -- the order ------------------------------------------------------------------------------------

    def order(self, trials: list[Trial]) -> Iterator[Trial]:
        import optuna
        from optuna.distributions import CategoricalDistribution
        from optuna.samplers import TPESampler
        from optuna.trial import TrialState

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        started = time.monotonic()
        rng = random.Random(self.settings.seed)
        keys = list(self.dims)
        # The values the planned trials hold (a dimension may be declared as "@device.power_modes", read at planning).
        labels = {k: list(dict.fromkeys(_label(t.point.get(k)) for t in trials)) for k in keys}
        cells: dict[tuple, Trial] = {}
        for t in trials:
            if t.round > 1:
                continue
            cells[tuple(_label(t.point.get(k)) for k in keys)] = t
        cell_of = {t.config_hash: c for c, t in cells.items()}
        candidates = []
        for cell, t in cells.items():
            why = self._ruled_out(t)
            if why:
                self.pruned.append((t, why))
            else:
                candidates.append(cell)
        if not keys or not candidates:
            self.stop_reason = "nothing to search: every cell was ruled out" if cells else "an empty grid"
            return
        distributions = {k: CategoricalDistribution(labels[k]) for k in keys}
        sampler = TPESampler(seed=self.settings.seed, n_startup_trials=min(10, max(3, len(candidates) // 10)),
                             multivariate=True)
        study = optuna.create_study(direction="maximize" if self.goal.direction > 0 else "minimize", sampler=sampler)
        remaining = set(candidates)
        patience = self.settings.patience or max(5, len(candidates) // 3)
        since_better, incumbent = 0, None

        while remaining or self._repeat_wanted(settle=True):
            if self.settings.budget_trials is not None and self.runs >= self.settings.budget_trials:
                self.stop_reason = f"the trial budget ({self.settings.budget_trials} runs) is spent"
                return
            if self.settings.budget_s is not None and time.monotonic() - started >= self.settings.budget_s:
                self.stop_reason = f"the time budget ({self.settings.budget_s:g} s) is spent"
                return
            # Repeats change verdicts (a pooled noise appears, a second run fails a bound): the incumbent is read
            # afresh every time, never kept from an earlier step.
            current = self._incumbent()
            if current != incumbent:
                incumbent = current
                since_better = 0 if current is not None else since_better
            budget = self.settings.budget_trials
            settling = not remaining or (incumbent is not None and (since_better >= patience or (
                budget is not None and self.runs >= math.ceil(GLOBAL_SHARE * budget))))
            again = self._repeat_wanted(settle=settling)
            if again is not None:  # adaptive repetitions: the undecided configuration once more
                m = self.measured[again]
                self.runs += 1
                yield dataclasses.replace(m.trial, round=len(m.runs) + m.failed + 1, rounds=self.settings.max_runs)
                continue
            if not remaining:
                break  # every cell measured, no repeat left to decide anything
            if incumbent is not None and self._none_can_beat(incumbent, [cells[c] for c in remaining]):
                self.stop_reason = "no configuration left unmeasured can beat the incumbent (its decode ceiling)"
                return
            cell, ot = None, None
            if settling and incumbent is not None:
                # The local phase: cells near the incumbent (one dimension changed, then two, ...), the most promising
                # first by the model of the measurements (dimension values' effects and pairs' interactions).
                score = self._model(keys, cell_of)
                leaders = [cell_of[h] for h in self._leaders(LEADERS) if h in cell_of]
                near: list[tuple] = []
                radius = 0
                while not near and radius < len(keys):
                    radius += 1
                    near = [c for c in remaining
                            if any(sum(a != b for a, b in zip(c, lead)) == radius for lead in leaders)]
                if not near or (budget is None and radius > 2):
                    self.stop_reason = (f"{patience} configurations in a row without a better feasible one, and "
                                        "every neighbour of the incumbent measured")
                    return
                cell = max(near, key=lambda c: (score(c), c))
                study.enqueue_trial(dict(zip(keys, cell)))
                ot = study.ask(distributions)
            for _ in range(0 if cell is not None else MAX_ASKS):
                ot = study.ask(distributions)
                key = tuple(ot.params[k] for k in keys)
                if key in remaining:
                    cell = key
                    break
                known = self.measured.get(cells[key].config_hash) if key in cells else None
                if known is not None and known.runs:
                    self._tell(study, ot, known)
                else:
                    study.tell(ot, state=TrialState.FAIL)
            if cell is None:  # every ask hit a measured or missing cell: an unmeasured one, at random
                cell = rng.choice(sorted(remaining))
                study.enqueue_trial(dict(zip(keys, cell)))
                ot = study.ask(distributions)
            remaining.discard(cell)
            trial = cells[cell]
            self.runs += 1
            yield trial
            m = self.measured.get(trial.config_hash)
            if m is None or not m.runs:
                study.tell(ot, state=TrialState.FAIL)
                since_better += 1
                continue
            self._tell(study, ot, m)
            best = self._incumbent()
            if best is not None and best != incumbent:
                incumbent, since_better = best, 0
            else:
                since_better += 1
        self.stop_reason = self.stop_reason or "every configuration of the grid was measured or ruled out"

    # -- decisions ------------------------------------------------------------------------------------

    def _tell(self, study: Any, ot: Any, m: Measured) -> None:
        e = m.estimate(self.goal.objective)
        if not e.known:
            from optuna.trial import TrialState

            study.tell(ot, state=TrialState.FAIL)
            return
        for i, v in enumerate(violations(self.goal, m)):
            ot.set_constraint(f"c{i}", v)
        study.tell(ot, e.mean)

    def cv(self, metric: str) -> Optional[float]:
        """The pooled relative run-to-run spread of `metric` over the configurations measured more than once (the
        noise a configuration measured once is judged with); None before there are 2 degrees of freedom of it."""
        ss, dof = 0.0, 0
        for m in self.measured.values():
            values = [float(r[metric]) for r in m.runs if metric in r and math.isfinite(float(r[metric]))]
            if len(values) < 2:
                continue
            mean = sum(values) / len(values)
            if mean == 0:
                continue
            ss += sum(((v - mean) / mean) ** 2 for v in values)
            dof += len(values) - 1
        return math.sqrt(ss / dof) if dof >= 2 else None

    def _model(self, keys: list[str], cell_of: dict[str, tuple]) -> Callable[[tuple], float]:
        """cell -> its predicted objective (in its better direction) from the configurations measured so far: a ridge
        regression on each dimension value (main effects) and each pair of values (interactions), the objective
        standardised, the pairs penalised more than the main effects (RIDGE_MAIN, RIDGE_PAIR). Fitted jointly, so a
        pair's effect is not mistaken for a value's. The pairs carry what an additive model misses and a
        neighbourhood search needs: flash attention pays with a quantized K cache and not without."""
        import numpy as np

        points = []
        for h, m in self.measured.items():
            e = m.estimate(self.goal.objective)
            if e.known and h in cell_of:
                points.append((cell_of[h], e.mean * self.goal.direction))
        if len(points) < 2:
            return lambda cell: 0.0
        pairs = [(i, j) for i in range(len(keys)) for j in range(i + 1, len(keys))]
        columns: dict[tuple, int] = {}
        for cell, _ in points:
            for i, v in enumerate(cell):
                columns.setdefault((i, v), len(columns))
            for i, j in pairs:
                columns.setdefault((i, cell[i], j, cell[j]), len(columns))

        def features(cell: tuple) -> list[int]:
            found = [columns.get((i, v)) for i, v in enumerate(cell)]
            found += [columns.get((i, cell[i], j, cell[j])) for i, j in pairs]
            return [c for c in found if c is not None]

        x = np.zeros((len(points), len(columns)))
        for row, (cell, _) in enumerate(points):
            x[row, features(cell)] = 1.0
        y = np.array([v for _, v in points])
        centre, scale = float(y.mean()), float(y.std()) or 1.0
        penalty = np.array([RIDGE_MAIN if len(k) == 2 else RIDGE_PAIR for k in columns])
        coef = np.linalg.solve(x.T @ x + np.diag(penalty), x.T @ ((y - centre) / scale))
        return lambda cell: centre + scale * float(sum(coef[c] for c in features(cell)))

    def _leaders(self, n: int) -> list[str]:
        """The n best configurations that meet the constraints so far (the incumbent first)."""
        ranked = []
        for h, m in self.measured.items():
            if verdict(self.goal, m, self.cv)[0] != MEETS:
                continue
            e = m.estimate(self.goal.objective)
            if e.known:
                ranked.append((e.mean * self.goal.direction, h))
        return [h for _, h in sorted(ranked, reverse=True)[:n]]

    def _incumbent(self) -> Optional[str]:
        """The config hash of the best configuration that meets the constraints so far."""
        best, best_value = None, None
        for h, m in self.measured.items():
            if verdict(self.goal, m, self.cv)[0] != MEETS:
                continue
            e = m.estimate(self.goal.objective)
            if e.known and (best_value is None or (e.mean - best_value) * self.goal.direction > 0):
                best, best_value = h, e.mean
        return best

    def _repeat_wanted(self, settle: bool = False) -> Optional[str]:
        """A measured configuration whose verdict the noise leaves open, with runs to spare: undecided on the
        constraints (always), or, once the search settles (`settle`: its local phase), one of the leaders whose
        objective cannot be told apart from the incumbent's."""
        inc = self._incumbent()
        leaders = set(self._leaders(LEADERS)) if settle else set()
        for h, m in self.measured.items():
            if not m.runs or len(m.runs) + m.failed >= self.settings.max_runs:
                continue
            v, _ = verdict(self.goal, m, self.cv)
            if v == UNDECIDED and all(m.estimate(c.metric).known for c in self.goal.constraints):
                return h  # (a metric the trial does not record stays missing however often it runs)
            if v == MEETS and inc is not None and h != inc and h in leaders:
                cv = self.cv(self.goal.objective)
                a, b = m.estimate(self.goal.objective, cv), self.measured[inc].estimate(self.goal.objective, cv)
                if (a.mean - b.mean) * self.goal.direction < 0 and not math.isfinite(_welch_p(a, b)):
                    continue
                p = _welch_p(a, b)
                # Not told apart from the incumbent (or no spread to tell it with): one more run decides.
                if not (p < self.goal.alpha):
                    return h
        return None

    def _ruled_out(self, trial: Trial) -> Optional[str]:
        for c in self.goal.constraints:
            if c.sense > 0:
                bound = self.upper_bound(trial, c.metric)
                if bound is not None and bound < c.bound:
                    return f"{c.metric} cannot reach {c.bound:g}: its ceiling is {bound:.3g}"
        return None

    def _none_can_beat(self, incumbent: str, left: list[Trial]) -> bool:
        if self.goal.direction < 0 or not left:
            return False
        best = self.measured[incumbent].estimate(self.goal.objective).mean
        for t in left:
            bound = self.upper_bound(t, self.goal.objective)
            if bound is None or bound > best:
                return False
        return True


def _label(value: Any) -> str:
    return str(value)


def decode_ceiling(trial: Trial, metric: str) -> Optional[float]:
    """An upper bound on decode_tps (`metric`) of a trial before it runs: the datasheet bandwidth of its device's
    profile over the model file's bytes per token (weights + KV at its depth). None where either is unknown."""
    if metric != "decode_tps":
        return None
    cfg = trial.cfg
    bandwidth = cfg.profile.memory_bandwidth_gbs if cfg.profile is not None else None
    if not isinstance(bandwidth, (int, float)) or not bandwidth > 0:
        return None
    from pathlib import Path

    from jbench.analysis.roofline import RooflineError, kv_bytes_at_depth, weight_bytes_per_token
    from jbench.models.facts import read_gguf_header
    from jbench.models.store import ModelError, resolve_model_file

    try:
        path, _ = resolve_model_file(cfg.model)
        if not Path(path).is_file():
            return None
        model = read_gguf_header(path)
        if any("_exps" in t.name for t in model.tensors):
            return None  # mixture of experts: only routed experts are read, so the full bytes give no upper bound
        backend = cfg.backend
        kv_types = (backend.cache_type_k, backend.cache_type_v) if isinstance(backend, ChoosesKVTypes) else ("f16", "f16")
        depth = backend.depth if isinstance(backend, FixedLengths) else 0
        total = weight_bytes_per_token(model).total + kv_bytes_at_depth(model.arch, depth, *kv_types).swa_aware
    except (ModelError, RooflineError, OSError, ValueError, KeyError):
        return None
    return bandwidth * 1e9 / total if total > 0 else None
