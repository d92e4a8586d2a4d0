"""Roofline cost model of one engine step, its presets, and calibration from measurements.

step time = overhead + per-sequence overhead × sequences + max(memory time, compute time), where
  memory time  = (weight bytes + KV bytes read) / (memory efficiency × bandwidth)
  compute time = (2 × params × new tokens + attention FLOPs) / (compute efficiency × peak)

The hardware numbers (bandwidth, peak FLOP/s) come from the data sheet; the fitted numbers
(the two overheads and the two efficiencies) absorb everything the roofline leaves out,
which is why `fit_roofline` recovers them from measured step times of the real engine.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from importlib import resources
from pathlib import Path


class CostModelError(ValueError):
    """A parameter file or a calibration set that cannot describe an engine."""


@dataclass(frozen=True)
class StepShape:
    """What one step computes, in the units the roofline needs.

    num_kv_tokens: context tokens whose KV the step reads (every chunk's start + length).
    num_attention_pairs: (query, key) pairs attended; for a decode step it equals
    num_kv_tokens, for a prefill chunk of n tokens after s cached ones it is n·(s + (n+1)/2).
    """

    num_batched_tokens: int
    num_kv_tokens: int
    num_attention_pairs: float | None = None
    num_seqs: int = 0  # sequences (chunks) in the step; 0 when not known

    @property
    def attention_pairs(self) -> float:
        if self.num_attention_pairs is None:
            return float(self.num_kv_tokens)
        return self.num_attention_pairs


def chunk_shape(start: int, num_tokens: int) -> tuple[int, float]:
    """KV tokens read and attention pairs of one chunk of `num_tokens` after `start`."""
    return start + num_tokens, num_tokens * (start + (num_tokens + 1) / 2)


@dataclass(frozen=True)
class RooflineParams:
    """One model on one accelerator, plus the engine's capacity limits on it."""

    name: str
    num_params: float
    weight_bytes: float
    kv_bytes_per_token: float
    attention_flops_per_token_pair: float
    memory_bandwidth_bytes_per_s: float
    peak_flops_per_s: float
    memory_efficiency: float
    compute_efficiency: float
    overhead_s: float
    # Host time per sequence in a step, beside the forward pass: sampling, detokenizing
    # and streaming its token (a serving process pays it per token it sends).
    overhead_per_seq_s: float = 0.0
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_prefill_chunk_tokens: int | None = None
    description: str = ""

    def __post_init__(self) -> None:
        positive = (
            "num_params",
            "weight_bytes",
            "kv_bytes_per_token",
            "memory_bandwidth_bytes_per_s",
            "peak_flops_per_s",
            "memory_efficiency",
            "compute_efficiency",
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
        )
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise CostModelError(f"{name} must be a number")
            if not math.isfinite(value) or value <= 0:
                raise CostModelError(f"{name} must be a finite number > 0")
        for name in ("overhead_s", "overhead_per_seq_s", "attention_flops_per_token_pair"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise CostModelError(f"{name} must be a finite number >= 0")

    # The two hot paths below run once per simulated step; they are written out flat.
    def memory_time_s(self, num_kv_tokens: int) -> float:
        read_bytes = self.weight_bytes + self.kv_bytes_per_token * num_kv_tokens
        return read_bytes / (self.memory_efficiency * self.memory_bandwidth_bytes_per_s)

    def compute_time_s(self, num_batched_tokens: int, num_attention_pairs: float) -> float:
        flops = (
            2.0 * self.num_params * num_batched_tokens
            + self.attention_flops_per_token_pair * num_attention_pairs
        )
        return flops / (self.compute_efficiency * self.peak_flops_per_s)

    def step_time_s(
        self,
        num_batched_tokens: int,
        num_kv_tokens: int,
        num_attention_pairs: float,
        num_seqs: int = 0,
    ) -> float:
        """Predicted wall time of one step; zero tokens cost nothing (no step runs)."""
        if num_batched_tokens <= 0:
            return 0.0
        return (
            self.overhead_s
            + self.overhead_per_seq_s * num_seqs
            + max(
                self.memory_time_s(num_kv_tokens),
                self.compute_time_s(num_batched_tokens, num_attention_pairs),
            )
        )

    def shape_time_s(self, shape: StepShape) -> float:
        return self.step_time_s(
            shape.num_batched_tokens, shape.num_kv_tokens, shape.attention_pairs, shape.num_seqs
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> RooflineParams:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise CostModelError(f"unknown cost model fields: {', '.join(unknown)}")
        try:
            return cls(**data)  # type: ignore[arg-type]
        except TypeError as exc:  # a required field is missing
            raise CostModelError(str(exc)) from exc


PRESETS = ("h200-llama-3.1-8b", "cpu-tiny")


def load_preset(name: str) -> RooflineParams:
    """A preset shipped with the package (see PRESETS)."""
    if name not in PRESETS:
        raise CostModelError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    text = resources.files("scheduler.sim").joinpath("presets", f"{name}.json").read_text()
    return RooflineParams.from_dict(json.loads(text))


def load_params(name_or_path: str | Path) -> RooflineParams:
    """A preset name, or a JSON file the user wrote (e.g. by `save_params` after calibration)."""
    if str(name_or_path) in PRESETS:
        return load_preset(str(name_or_path))
    path = Path(name_or_path)
    if not path.is_file():
        raise CostModelError(
            f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a file"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CostModelError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise CostModelError(f"{path}: expected a JSON object")
    return RooflineParams.from_dict(data)


def save_params(params: RooflineParams, path: str | Path) -> None:
    Path(path).write_text(json.dumps(params.to_dict(), indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class StepSample:
    """One measured step of the real engine."""

    shape: StepShape
    step_s: float


@dataclass(frozen=True)
class FitResult:
    params: RooflineParams
    mean_abs_rel_error: float  # over the samples, after the fit
    num_samples: int


def read_samples(lines: Iterable[str]) -> list[StepSample]:
    """JSON lines with num_batched_tokens, num_kv_tokens, step_s (and optionally
    num_attention_pairs and num_seqs), as the engine's step log writes them."""
    samples = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            shape = StepShape(
                int(row["num_batched_tokens"]),
                int(row["num_kv_tokens"]),
                row.get("num_attention_pairs"),
                int(row.get("num_seqs", 0)),
            )
            samples.append(StepSample(shape, float(row["step_s"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise CostModelError(f"sample line {lineno}: {exc}") from exc
    return samples


def fit_roofline(base: RooflineParams, samples: Sequence[StepSample]) -> FitResult:
    """Fit overhead_s, memory_efficiency and compute_efficiency to measured step times,
    and overhead_per_seq_s when the samples count their sequences (else it is 0).

    The max() makes the model piecewise linear, so least squares has no closed form; we
    search the two efficiencies on a log grid that narrows around the best point, and for
    each pair the overheads that minimise the squared relative error are a weighted
    linear least squares (both kept >= 0). Relative error so that short decode steps
    count as much as long prefills.
    """
    usable = [s for s in samples if s.shape.num_batched_tokens > 0 and s.step_s > 0]
    if len(usable) < 3:
        raise CostModelError("calibration needs at least 3 steps with tokens and a time > 0")
    unit_mem = replace(base, memory_efficiency=1.0, compute_efficiency=1.0, overhead_s=0.0)
    mem = [unit_mem.memory_time_s(s.shape.num_kv_tokens) for s in usable]
    comp = [
        unit_mem.compute_time_s(s.shape.num_batched_tokens, s.shape.attention_pairs) for s in usable
    ]
    times = [s.step_s for s in usable]
    weights = [1.0 / (t * t) for t in times]
    seqs = [s.shape.num_seqs for s in usable]
    overheads = _OverheadFit(weights, seqs)

    def evaluate(eff_mem: float, eff_comp: float) -> tuple[float, float, float]:
        rest = [
            t - max(m / eff_mem, c / eff_comp) for t, m, c in zip(times, mem, comp, strict=True)
        ]
        overhead, per_seq = overheads.solve(rest)
        err = sum(
            w * (y - overhead - per_seq * n) ** 2
            for w, y, n in zip(weights, rest, seqs, strict=True)
        )
        return err, overhead, per_seq

    log_lo, log_hi = math.log(1e-4), math.log(2.0)
    lo_m, hi_m, lo_c, hi_c = log_lo, log_hi, log_lo, log_hi
    best = (math.inf, 0.0, 0.0, 1.0, 1.0)
    for _ in range(6):
        n = 24
        for i in range(n + 1):
            eff_mem = math.exp(lo_m + (hi_m - lo_m) * i / n)
            for j in range(n + 1):
                eff_comp = math.exp(lo_c + (hi_c - lo_c) * j / n)
                err, overhead, per_seq = evaluate(eff_mem, eff_comp)
                if err < best[0]:
                    best = (err, overhead, per_seq, eff_mem, eff_comp)
        # Narrow to two grid cells around the best point and search again.
        span_m, span_c = (hi_m - lo_m) * 2 / n, (hi_c - lo_c) * 2 / n
        cm, cc = math.log(best[3]), math.log(best[4])
        lo_m, hi_m = max(log_lo, cm - span_m), min(log_hi, cm + span_m)
        lo_c, hi_c = max(log_lo, cc - span_c), min(log_hi, cc + span_c)
    _, overhead, per_seq, eff_mem, eff_comp = best
    fitted = replace(
        base,
        overhead_s=overhead,
        overhead_per_seq_s=per_seq,
        memory_efficiency=eff_mem,
        compute_efficiency=eff_comp,
    )
    rel = [abs(fitted.shape_time_s(s.shape) - s.step_s) / s.step_s for s in usable]
    return FitResult(fitted, sum(rel) / len(rel), len(usable))


class _OverheadFit:
    """min Σ w·(y − overhead − per_seq·n)² over overhead, per_seq >= 0, for fixed weights
    and sequence counts (the normal equations' sums that do not depend on y are kept)."""

    def __init__(self, weights: Sequence[float], seqs: Sequence[int]) -> None:
        self.weights, self.seqs = weights, seqs
        self.fits_per_seq = any(seqs)
        self.sw = sum(weights)
        self.sn = sum(w * n for w, n in zip(weights, seqs, strict=True))
        self.snn = sum(w * n * n for w, n in zip(weights, seqs, strict=True))

    def solve(self, rest: Sequence[float]) -> tuple[float, float]:
        sy = sum(w * y for w, y in zip(self.weights, rest, strict=True))
        only_overhead = (max(0.0, sy / self.sw), 0.0)
        if not self.fits_per_seq:
            return only_overhead
        sny = sum(w * n * y for w, n, y in zip(self.weights, self.seqs, rest, strict=True))
        det = self.sw * self.snn - self.sn * self.sn
        if det > 0:
            overhead = (self.snn * sy - self.sn * sny) / det
            per_seq = (self.sw * sny - self.sn * sy) / det
            if overhead >= 0 and per_seq >= 0:
                return overhead, per_seq
        # The optimum lies on an edge: one of the two is zero; take the better edge.
        only_per_seq = (0.0, max(0.0, sny / self.snn))

        def err(o: float, c: float) -> float:
            return (
                self.sw * o * o + 2 * o * c * self.sn + self.snn * c * c - 2 * o * sy - 2 * c * sny
            )

        return min((only_overhead, only_per_seq), key=lambda oc: err(*oc))
