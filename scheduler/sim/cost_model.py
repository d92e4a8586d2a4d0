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
from dataclasses import MISSING, asdict, dataclass, fields, replace
from importlib import resources
from pathlib import Path

from engine.step_scheduler import SchedulerConfig


class CostModelError(ValueError):
    """A parameter file or a calibration set that cannot describe an engine."""


# The simulator's model length unless a FleetSpec says otherwise (a long-context model).
DEFAULT_MAX_MODEL_LEN = 16384
# Per engine: the simulated block manager holds an object per block (~140 bytes, ~0.7 µs
# to build); a million blocks is 16 M tokens at 16 per block, beyond any one GPU's cache.
MAX_KV_BLOCKS = 2**20
# A preset file is a screen of JSON; reading a huge one would only stall.
MAX_PARAMS_FILE_BYTES = 2**20
# A samples file is ~100-150 bytes a step: 64 MiB is some 500,000 steps, hundreds of
# times what `calibrate --measure` writes (~2,000) and more than an hour of a busy
# engine's step log, while reading it stays within a few hundred MB of memory. A device
# or a runaway file (/dev/zero) would otherwise be read until memory runs out.
MAX_SAMPLES_FILE_BYTES = 64 * 2**20

_POSITIVE_NUMBERS = (
    "num_params",
    "weight_bytes",
    "kv_bytes_per_token",
    "attention_flops_per_token_pair",  # attention costs FLOPs in every model: 0 is a typo
    "memory_bandwidth_bytes_per_s",
    "peak_flops_per_s",
)
_NON_NEGATIVE_NUMBERS = ("overhead_s", "overhead_per_seq_s")
_FRACTIONS = ("memory_efficiency", "compute_efficiency")
_COUNTS = ("block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens")


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
        for name in ("name", "description"):
            if not isinstance(getattr(self, name), str):
                raise CostModelError(f"{name} must be a string")
        for name in _POSITIVE_NUMBERS:
            if not _number(getattr(self, name)) > 0:
                raise CostModelError(f"{name} must be a finite number > 0")
        for name in _NON_NEGATIVE_NUMBERS:
            if not _number(getattr(self, name)) >= 0:
                raise CostModelError(f"{name} must be a finite number >= 0")
        for name in _FRACTIONS:
            # Fractions of the data sheet's peak: above 1 the hardware numbers are wrong.
            if not 0 < _number(getattr(self, name)) <= 1:
                raise CostModelError(f"{name} must be a fraction of peak in (0, 1]")
        for name in _COUNTS:
            _set_count(self, name, getattr(self, name), allow_none=False)
        # null is the engine's "no cap beyond the step's token budget" (EngineConfig); the
        # engine refuses 0, so a 0 here would be a typo, not a setting.
        _set_count(self, "max_prefill_chunk_tokens", self.max_prefill_chunk_tokens, allow_none=True)
        if self.num_kv_blocks > MAX_KV_BLOCKS:
            raise CostModelError(f"num_kv_blocks must be at most {MAX_KV_BLOCKS:,}")
        try:
            config = self.scheduler_config(DEFAULT_MAX_MODEL_LEN)
        except ValueError as exc:  # the limits the real step scheduler refuses
            raise CostModelError(str(exc)) from None
        if self.num_kv_blocks <= config.watermark_blocks:
            # The step scheduler takes a request only while more than the watermark's
            # blocks are free (StepScheduler.can_accept): such an engine never takes one.
            raise CostModelError(
                f"num_kv_blocks must be at least {config.watermark_blocks + 1}: the step "
                f"scheduler keeps {config.watermark_blocks} blocks free, so a cache of "
                f"{self.num_kv_blocks} never takes a request"
            )
        # The longest step the limits allow (every cached token read, the full token
        # budget attending to all of them) bounds every step: a time that overflows
        # would put the virtual clock at infinity.
        num_cached = self.num_kv_blocks * self.block_size
        try:
            longest = self.step_time_s(
                self.max_num_batched_tokens,
                num_cached,
                float(self.max_num_batched_tokens) * num_cached,
                self.max_num_seqs,
            )
        except OverflowError:  # a count beyond any float
            longest = math.inf
        if not math.isfinite(longest) or not self.step_time_s(1, 1, 1.0, 1) > 0:
            raise CostModelError(
                "the cost model predicts step times that are not finite and > 0; "
                "check the sizes, rates and efficiencies"
            )

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The real step scheduler's limits for this engine (it validates them)."""
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_prefill_chunk_tokens=self.max_prefill_chunk_tokens or self.max_num_batched_tokens,
            # As LLMEngine caps it: a request longer than the whole cache can never run.
            max_model_len=min(max_model_len, self.num_kv_blocks * self.block_size),
        )

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
        required = [
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        ]
        missing = [name for name in required if name not in data]
        if missing:
            raise CostModelError(f"the cost model misses fields: {', '.join(missing)}")
        return cls(**data)  # type: ignore[arg-type]


def _number(value: object) -> float:
    """A JSON number as a float; NaN (which fails every comparison) for anything else,
    so that one `not lo < x <= hi` check refuses booleans, strings, NaN and infinities."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return math.nan
    try:
        number = float(value)
    except OverflowError:  # an integer literal beyond any float
        return math.nan
    return number if math.isfinite(number) else math.nan


def _set_count(params: RooflineParams, name: str, value: object, *, allow_none: bool) -> None:
    """Check a positive integer field; a whole float (4.8e4) is stored as the int."""
    if value is None and allow_none:
        return
    number = _number(value)
    if not (number >= 1 and number == int(number)):
        extra = " or null" if allow_none else ""
        raise CostModelError(f"{name} must be a whole number >= 1{extra}, got {value!r:.40}")
    object.__setattr__(params, name, int(value))  # type: ignore[arg-type]


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
    if path.is_dir():
        raise CostModelError(f"{path}: is a directory, not a cost model file")
    if not path.is_file():
        raise CostModelError(
            f"{name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a file"
        )
    try:
        text = read_small_file(path, MAX_PARAMS_FILE_BYTES, "a cost model").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CostModelError(f"{path}: not UTF-8 text ({exc.reason})") from None
    data = parse_json_object(text, path)
    try:
        return RooflineParams.from_dict(data)
    except CostModelError as exc:
        raise CostModelError(f"{path}: {exc}") from None


def read_small_file(path: Path, max_bytes: int, kind: str) -> bytes:
    """The bytes of a file the user named (`kind`, for the error: "a cost model"), or a
    CostModelError saying why not. At most `max_bytes` are read."""
    try:
        with path.open("rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise CostModelError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise CostModelError(f"{path}: larger than {max_bytes:,} bytes, not {kind}")
    return data


def parse_json_object(text: str, path: Path | str) -> dict[str, object]:
    """One JSON object, or a CostModelError naming `path` (a file, or a line of one)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, absurd nesting
        reason = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        raise CostModelError(f"{path}: not valid JSON ({reason})") from None
    if not isinstance(value, dict):
        raise CostModelError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


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
    num_attention_pairs and num_seqs), as the engine's step log writes them. Values
    outside what one engine step can be (see MAX_SAMPLE_COUNT, MIN_SAMPLE_STEP_S,
    MAX_SAMPLE_STEP_S) are refused: they are typos, and would under- or overflow the
    fit's float arithmetic."""
    samples = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = parse_json_object(line, f"sample line {lineno}")
            num_tokens = _sample_count(row, "num_batched_tokens")
            num_kv = _sample_count(row, "num_kv_tokens")
            shape = StepShape(
                num_tokens,
                num_kv,
                _sample_pairs(row.get("num_attention_pairs"), num_tokens * num_kv),
                _sample_count(row, "num_seqs", 0),
            )
            samples.append(StepSample(shape, _sample_step_s(row.get("step_s"))))
        except ValueError as exc:  # CostModelError included
            message = str(exc).removeprefix(f"sample line {lineno}: ")
            raise CostModelError(f"sample line {lineno}: {message}") from None
    return samples


def read_samples_file(path: Path) -> list[StepSample]:
    """`read_samples` of a file the user named; a directory, a device or a pipe, a file
    over MAX_SAMPLES_FILE_BYTES, unreadable or not UTF-8 is a CostModelError."""
    if path.is_dir():
        raise CostModelError(f"{path}: is a directory, not a samples file")
    if path.exists() and not path.is_file():
        raise CostModelError(f"{path}: not a regular file (a device or a pipe), not samples")
    try:
        data = read_small_file(path, MAX_SAMPLES_FILE_BYTES, "a samples file")
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CostModelError(f"{path}: not UTF-8 text ({exc.reason})") from None
    return read_samples(text.splitlines())


# Tokens, KV tokens read and sequences of one measured step. A step reads at most its
# engine's whole cache, and the simulator's largest (2^20 blocks) holds 2^24 tokens at
# 16 a block: 2^30 leaves room for any block size and is still no typo's 10^12.
MAX_SAMPLE_COUNT = 2**30
# A step's wall time: 100 ns is less than one kernel launch, 10^4 s (almost three
# hours) more than any step; outside, a time is a typo in units (or 1e-200, whose
# squared inverse, the fit's weight, is no float). 0 stays allowed: the fit skips it.
MIN_SAMPLE_STEP_S = 1e-7
MAX_SAMPLE_STEP_S = 1e4


def _sample_count(row: dict[str, object], key: str, default: int | None = None) -> int:
    if key not in row and default is not None:
        return default
    if key not in row:
        raise ValueError(f"missing {key}")
    value = row[key]
    number = _number(value)
    if not (0 <= number <= MAX_SAMPLE_COUNT and number == int(number)):
        raise ValueError(
            f"{key} must be a whole number in [0, {MAX_SAMPLE_COUNT:,}] (one engine step), "
            f"got {value!r:.40}"
        )
    return int(number)


def _sample_pairs(value: object, most: int) -> float | None:
    """(query, key) pairs: each of the step's new tokens attends to at most every token
    it reads, so at most num_batched_tokens × num_kv_tokens (`most`)."""
    if value is None:
        return None
    number = _number(value)
    if not 0 <= number <= most:
        raise ValueError(
            "num_attention_pairs must be a finite number in [0, num_batched_tokens x "
            f"num_kv_tokens = {most:,}], got {value!r:.40}"
        )
    return number


def _sample_step_s(value: object) -> float:
    number = _number(value)
    if not (number == 0 or MIN_SAMPLE_STEP_S <= number <= MAX_SAMPLE_STEP_S):
        raise ValueError(
            f"step_s must be 0 or a finite number of seconds in [{MIN_SAMPLE_STEP_S:g}, "
            f"{MAX_SAMPLE_STEP_S:g}], got {value!r:.40}"
        )
    return number


def fit_roofline(base: RooflineParams, samples: Sequence[StepSample]) -> FitResult:
    """Fit overhead_s, memory_efficiency and compute_efficiency to measured step times,
    and overhead_per_seq_s when the samples count their sequences (else it is 0).

    The max() makes the model piecewise linear, so least squares has no closed form; we
    search the two efficiencies on a log grid that narrows around the best point, and for
    each pair the overheads that minimise the squared relative error are a weighted
    linear least squares (both kept >= 0). Relative error so that short decode steps
    count as much as long prefills. Where the steps ran faster than the base's bandwidth
    or peak allow at full efficiency, that number is raised to what they show and the
    efficiency is 1.
    """
    usable = [s for s in samples if s.shape.num_batched_tokens > 0 and s.step_s > 0]
    fitted = ["overhead_s", "memory_efficiency", "compute_efficiency"]
    if any(s.shape.num_seqs for s in usable):
        fitted.append("overhead_per_seq_s")
    # Steps of one shape are one equation however many there are, and as many shapes as
    # parameters are fitted exactly whatever the model's error: "mean error 0.0%" said
    # nothing. One shape more than parameters is the least that tests the fit.
    num_shapes = len({s.shape for s in usable})
    if num_shapes <= len(fitted):
        raise CostModelError(
            f"calibration needs steps of at least {len(fitted) + 1} distinct step shapes "
            f"(tokens, KV tokens, attention pairs, sequences) with tokens and a time > 0 to "
            f"fit {', '.join(fitted)} and test the fit; got {num_shapes}"
        )
    try:
        result = _fit(base, usable)
    except (ArithmeticError, CostModelError):  # over- or underflow, a division by 0
        result = None
    if result is None or not math.isfinite(result.mean_abs_rel_error):
        # read_samples keeps every value within one engine step's range; a base whose
        # sizes or rates are extreme can still make the predicted times overflow.
        raise CostModelError(
            f"the {len(usable)} steps cannot be fitted with base {base.name!r}: the "
            "predicted step times are not finite; check the base's sizes and rates, "
            "and the samples' units"
        )
    return result


def _fit(base: RooflineParams, usable: Sequence[StepSample]) -> FitResult | None:
    """fit_roofline's search on samples with tokens and a time > 0; None when no point of
    the grid has a finite error."""
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

    # The search runs past 1: steps faster than the base's bandwidth or peak allow (a
    # placeholder, or a data sheet for another part) mean the number is too low for this
    # machine. Pinned at 1, the overheads used to absorb the rest, and the fit then
    # overpredicted long steps (prefills 15-30% on the cpu-tiny base) and underpredicted
    # short ones. Above 1 the excess goes into the hardware number below, so the
    # efficiencies stay fractions of peak, (0, 1], as RooflineParams requires.
    log_lo, log_hi = math.log(1e-4), math.log(1e3)
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
    err, overhead, per_seq, eff_mem, eff_comp = best
    if not math.isfinite(err):
        return None
    fitted = replace(
        base,
        # Reports name the preset they ran: the fit is not the stock one it started from.
        name=base.name if base.name.endswith("-calibrated") else f"{base.name}-calibrated",
        description=f"{base.name} fitted to {len(usable)} measured steps",
        overhead_s=overhead,
        overhead_per_seq_s=per_seq,
        memory_efficiency=min(eff_mem, 1.0),
        compute_efficiency=min(eff_comp, 1.0),
        memory_bandwidth_bytes_per_s=base.memory_bandwidth_bytes_per_s * max(eff_mem, 1.0),
        peak_flops_per_s=base.peak_flops_per_s * max(eff_comp, 1.0),
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
