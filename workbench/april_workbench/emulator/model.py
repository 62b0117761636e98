"""The emulator's synthetic "language model": a pure function from coordinates to tokens.

Every output token, its log-prob and the decision to stop there are a pure function of
``(emulator seed, prompt key, sampling_seed, absolute position, weight version)``. The prompt key is
a hash of the first four input tokens, so a resumed call (prompt + partial response as input) keeps
the key, and positions are absolute (index in prompt + response), so a resumed call continues exactly
the stream an uninterrupted call would have produced under the same versions.

Response lengths: each prompt key has a difficulty latent that sets its typical length (lognormal
across prompts), each sample draws a length scale around it (lognormal, smaller sigma), and the stop
itself comes from a per-position Weibull hazard on the *absolute* position. A hazard on absolute
positions is what makes stopping resume-invariant; the price is that the length is measured from
position 0, i.e. includes the prompt, which is negligible when prompts are short next to responses.
A configurable fraction of samples (more likely for long-length prompts) never stop and run to
``max_new_tokens``, the way real policies loop on hard problems.

All hashing is vectorised splitmix64 on uint64 numpy arrays; nothing here loops per token.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)
_MIX1 = _U64(0xBF58476D1CE4E5B9)
_MIX2 = _U64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1

# Distinct salts so token ids, log-probs and stop draws are independent streams of one hash.
_SALT_TOKEN = 0x746F6B656E5F6964
_SALT_LOGPROB = 0x6C6F675F70726F62
_SALT_STOP = 0x73746F705F647261
_SALT_PROMPT_Z = 0x70726F6D70745F7A
_SALT_SAMPLE_Z1 = 0x73616D706C655F31
_SALT_SAMPLE_Z2 = 0x73616D706C655F32
_SALT_RUNAWAY = 0x72756E6177617921
_SALT_PROMPT_Z2 = 0x70726F6D70745F32
_SALT_RUNAWAY2 = 0x72756E6177617932
_STD_NORMAL = statistics.NormalDist()

PROMPT_KEY_TOKENS = 4
_SEARCH_CHUNK = 4096


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser, element-wise on a uint64 array (wrapping arithmetic)."""
    z = x.astype(_U64, copy=True)
    z += _GOLDEN
    z ^= z >> _U64(30)
    z *= _MIX1
    z ^= z >> _U64(27)
    z *= _MIX2
    z ^= z >> _U64(31)
    return z


def _mix_scalar(*values: int) -> int:
    """Fold integers (any sign/size, taken mod 2**64) into one 64-bit hash."""
    h = np.zeros(1, dtype=_U64)
    for v in values:
        h = splitmix64(h ^ _U64(int(v) & _MASK64))
    return int(h[0])


def _uniform(h: np.ndarray) -> np.ndarray:
    """53 high bits of a uint64 hash as a float in [0, 1)."""
    return (h >> _U64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _mix(*values: np.ndarray | int) -> np.ndarray:
    """``_mix_scalar`` element-wise: fold uint64 arrays (or ints, broadcast) into one hash each."""
    words = [np.asarray(int(v) & _MASK64, dtype=_U64) if isinstance(v, (int, np.integer))
             else np.asarray(v).astype(np.int64).astype(_U64) if np.asarray(v).dtype != _U64 else np.asarray(v)
             for v in values]  # int64 wraps to its two's complement, as ``& _MASK64`` does
    h = np.zeros(np.broadcast(*words).shape, dtype=_U64)
    for w in words:
        h = splitmix64(h ^ w)
    return h


def _normal(base: np.ndarray, salt_a: int, salt_b: int) -> np.ndarray:
    """Standard normal draws (Box-Muller) from two hashes of each ``base``, with ``math``'s
    functions, so a value never depends on how many were computed at once (numpy's vector exp,
    log and cos may differ in the last bit)."""
    u1 = _uniform(splitmix64(base ^ _U64(salt_a)))
    u2 = _uniform(splitmix64(base ^ _U64(salt_b)))
    return np.array([math.sqrt(-2.0 * math.log(1.0 - a)) * math.cos(2.0 * math.pi * b)
                     for a, b in zip(u1.ravel().tolist(), u2.ravel().tolist())]).reshape(u1.shape)


def prompt_key(input_ids: Sequence[int]) -> int:
    """Hash of the first four input tokens (of however many there are, for shorter inputs)."""
    head = [int(t) for t in list(input_ids[:PROMPT_KEY_TOKENS])]
    return _mix_scalar(len(head), *head)


# ---------------------------------------------------------------------------------------------
LENGTH_KINDS = ("lognormal-correlated", "max-length")


@dataclass(frozen=True)
class LengthModel:
    """How long responses are.

    ``lognormal-correlated``: prompt typical length = ``median_tokens * exp(prompt_sigma * z_p)``;
    sample length scale = prompt length * ``exp(sample_sigma * z_s)``; the sample stops at the first
    position whose Weibull(``shape``) hazard draw fires (mean = the sample's length scale; larger
    shape = tighter around it). A fraction ``truncation_fraction`` of samples never stops and runs to
    max_new_tokens; ``truncation_prompt_correlation`` (rho in [0, 1]) is the correlation of that
    event's latent with the prompt's length latent (1 = only the longest prompts run away).
    ``max-length``: every sample runs to max_new_tokens.
    """

    kind: str = "lognormal-correlated"
    median_tokens: float = 1500.0
    prompt_sigma: float = 0.9
    sample_sigma: float = 0.2
    shape: float = 5.0
    truncation_fraction: float = 0.02
    truncation_prompt_correlation: float = 0.9

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"length kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if not (self.median_tokens >= 1.0 and math.isfinite(self.median_tokens)):
            raise ValueError(f"median_tokens must be >= 1, got {self.median_tokens}")
        if not 0.0 <= self.truncation_prompt_correlation <= 1.0:
            raise ValueError("truncation_prompt_correlation must be in [0, 1], got "
                             f"{self.truncation_prompt_correlation}")
        for name in ("prompt_sigma", "sample_sigma"):
            value = getattr(self, name)
            if not (value >= 0.0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite value >= 0, got {value}")
        if not (self.shape > 0.0 and math.isfinite(self.shape)):
            raise ValueError(f"shape must be > 0, got {self.shape}")
        if not 0.0 <= self.truncation_fraction <= 1.0:
            raise ValueError(f"truncation_fraction must be in [0, 1], got {self.truncation_fraction}")

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LengthModel:
        """A named parameter set (see ``LENGTH_PRESETS``), with optional field overrides."""
        if name not in LENGTH_PRESETS:
            raise ValueError(f"unknown length preset {name!r}; known: {sorted(LENGTH_PRESETS)}")
        return replace(LENGTH_PRESETS[name], **overrides)

    @classmethod
    def parse(cls, spec: str) -> LengthModel:
        """``"preset"`` or ``"preset:key=value,key=value"`` (keys are field names)."""
        name, _, rest = spec.partition(":")
        overrides: dict[str, Any] = {}
        known = {f.name: f for f in fields(cls)}
        for item in filter(None, (s.strip() for s in rest.split(","))):
            key, eq, value = item.partition("=")
            if not eq or key not in known:
                raise ValueError(f"bad length parameter {item!r}; keys: {sorted(known)}")
            overrides[key] = value if key == "kind" else float(value)
        return cls.preset(name or "default", **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# The spread within a prompt's group and the samples that never stop, shared by the fitted laws;
# APRIL's laws raise the Weibull shape until a group's spread is within the < 1,500 tokens APRIL
# measured for GRPO (§3.2.3, fig. 8).
_GROUP_SPREAD = dict(sample_sigma=0.1, shape=4.0, truncation_fraction=0.02, truncation_prompt_correlation=0.8)

LENGTH_PRESETS: dict[str, LengthModel] = {
    "default": LengthModel(),
    # The benchmark's laws: each one's median and tail across prompts (prompt_sigma) are fitted
    # jointly on its fit rows and, for the APRIL laws, APRIL's length statistics (batch spread
    # 4,000-4,500 tokens, within-group < 1,500, ~40% carried-over tokens): `april-slime bench
    # reproduce --fit`, docs/results/calibration/fit.json, docs/bench.md.
    # DAPO-Math-17k on Qwen3 at a 16K budget (APRIL, the headline, the verl recipe).
    "dapo-math-qwen3-4b-16k": LengthModel(**{**_GROUP_SPREAD, "shape": 7.63866}, median_tokens=9000.0,
                                          prompt_sigma=0.51454),
    # DeepMath-103K on Qwen3 at 16K (APRIL fig. 4, fitted on its Qwen3-4B GRPO row).
    "deepmath-qwen3-16k": LengthModel(**{**_GROUP_SPREAD, "shape": 6.47233}, median_tokens=7500.0,
                                      prompt_sigma=0.564158),
    # DeepScaleR-Preview (AIME/AMC/Omni-MATH/STILL problems) for the reasoning models CoPRIS
    # trained: R1-Distill-Qwen (1.5B/7B; fitted on CoPRIS tab. 1's 7B step times) and Qwen3-8B in
    # thinking mode (fitted on tab. 1's Qwen3-8B step times).
    "deepscaler-r1-distill": LengthModel(median_tokens=7000.0, prompt_sigma=0.9, **_GROUP_SPREAD),
    "deepscaler-qwen3-8b": LengthModel(median_tokens=8500.0, prompt_sigma=0.4, **_GROUP_SPREAD),
    # Short responses for tests and quick runs.
    "short": LengthModel(median_tokens=48.0, prompt_sigma=0.6, sample_sigma=0.2, shape=5.0,
                         truncation_fraction=0.05, truncation_prompt_correlation=0.9),
    "max-length": LengthModel(kind="max-length"),
}


# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SampleProfile:
    """Version-independent properties of one sample: its Weibull scale, or None if it never stops."""

    key: int
    sampling_seed: int
    scale: float | None


@dataclass(frozen=True)
class SyntheticLM:
    """Token, log-prob and stop streams of the emulator. Immutable; share one per cluster."""

    seed: int = 0
    vocab_size: int = 151936
    eos_token_id: int = 151645
    # Mean of -logprob per token; real policies at temperature 1 sit around a few tenths.
    logprob_scale: float = 0.3
    length: LengthModel = field(default_factory=LengthModel)

    def __post_init__(self) -> None:
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(f"eos_token_id {self.eos_token_id} outside vocab of {self.vocab_size}")
        if not (self.logprob_scale > 0 and math.isfinite(self.logprob_scale)):
            raise ValueError(f"logprob_scale must be > 0, got {self.logprob_scale}")

    # -- per-sample constants ------------------------------------------------------------------
    def _base(self, key: int, sampling_seed: int) -> int:
        return _mix_scalar(self.seed, key, sampling_seed)

    def profile(self, key: int, sampling_seed: int) -> SampleProfile:
        scale = float(self.scales(np.array([key], dtype=_U64), np.array([sampling_seed], dtype=np.int64))[0])
        return SampleProfile(key, sampling_seed, None if math.isnan(scale) else scale)

    def scales(self, keys: np.ndarray, sampling_seeds: np.ndarray) -> np.ndarray:
        """Every sample's Weibull scale (NaN: it never stops), for arrays of prompt keys (uint64)
        and sampling seeds; what ``profile`` reads one of, and batch statistics read thousands of."""
        lm = self.length
        keys = np.asarray(keys, dtype=_U64)
        if lm.kind == "max-length":
            return np.full(np.broadcast(keys, sampling_seeds).shape, np.nan)
        z_prompt = _normal(_mix(self.seed, keys), _SALT_PROMPT_Z, _SALT_PROMPT_Z2)
        base = _mix(self.seed, keys, np.asarray(sampling_seeds, dtype=np.int64))
        z_sample = _normal(base, _SALT_SAMPLE_Z1, _SALT_SAMPLE_Z2)
        exponent = lm.prompt_sigma * z_prompt + lm.sample_sigma * z_sample
        mean_len = lm.median_tokens * np.array([math.exp(x) for x in exponent.ravel().tolist()]).reshape(exponent.shape)
        # Weibull scale whose mean is mean_len.
        scale = np.maximum(1.0, mean_len / math.gamma(1.0 + 1.0 / lm.shape))
        # A sample runs away when a latent correlated (rho) with the prompt's difficulty passes the
        # threshold that makes the marginal fraction exactly truncation_fraction: runaways cluster
        # on the long prompts, as they do for real policies.
        if lm.truncation_fraction >= 1.0:
            return np.full(scale.shape, np.nan)
        if lm.truncation_fraction > 0.0:
            rho = lm.truncation_prompt_correlation
            z_runaway = _normal(base, _SALT_RUNAWAY, _SALT_RUNAWAY2)
            latent = rho * z_prompt + math.sqrt(1.0 - rho * rho) * z_runaway
            scale = np.where(latent > _STD_NORMAL.inv_cdf(1.0 - lm.truncation_fraction), np.nan, scale)
        return scale

    # -- per-position streams ------------------------------------------------------------------
    def _position_hash(self, key: int, sampling_seed: int, positions: np.ndarray,
                       versions: np.ndarray | int) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64).astype(_U64)
        ver = np.asarray(versions, dtype=np.int64).astype(_U64)
        coord = splitmix64(pos ^ (ver << _U64(40)) ^ (ver >> _U64(24)))
        return coord ^ _U64(self._base(key, sampling_seed))

    def tokens(self, key: int, sampling_seed: int, positions: np.ndarray,
               versions: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """Normal (non-EOS) token ids and their log-probs at absolute ``positions``."""
        h = self._position_hash(key, sampling_seed, positions, versions)
        raw = splitmix64(h ^ _U64(_SALT_TOKEN)) % _U64(self.vocab_size - 1)
        ids = raw.astype(np.int64)
        ids += ids >= self.eos_token_id  # skip the EOS id
        u = _uniform(splitmix64(h ^ _U64(_SALT_LOGPROB)))
        # Exponential draw: mostly near zero with a tail, always finite and strictly negative.
        logprobs = -(1e-4 + self.logprob_scale * -np.log1p(-u))
        return ids, np.maximum(logprobs, -30.0)

    def stops(self, profile: SampleProfile, positions: np.ndarray,
              versions: np.ndarray | int) -> np.ndarray:
        """Whether the token at each absolute position is EOS."""
        positions = np.asarray(positions, dtype=np.int64)
        if profile.scale is None:
            return np.zeros(positions.shape, dtype=bool)
        h = self._position_hash(profile.key, profile.sampling_seed, positions, versions)
        u = _uniform(splitmix64(h ^ _U64(_SALT_STOP)))
        k = self.length.shape
        p = positions.astype(np.float64)
        cum_hazard = ((p + 1.0) / profile.scale) ** k - (p / profile.scale) ** k
        return u < -np.expm1(-cum_hazard)

    def first_stop(self, profile: SampleProfile, start: int, limit: int, version: int) -> int | None:
        """First absolute position in [start, limit) that is EOS under ``version``, else None."""
        if profile.scale is None:
            return None
        lo = start
        while lo < limit:
            hi = min(limit, lo + _SEARCH_CHUNK)
            hits = np.flatnonzero(self.stops(profile, np.arange(lo, hi), version))
            if hits.size:
                return lo + int(hits[0])
            lo = hi
        return None

    # -- reference streams for tests and analysis ----------------------------------------------
    def reference(self, prompt_ids: Sequence[int], sampling_seed: int, start_pos: int,
                  versions: Sequence[int] | np.ndarray) -> tuple[list[int], list[float]]:
        """Tokens and log-probs at positions ``start_pos, start_pos+1, ...`` generated with the
        given per-token versions, with EOS where the stop draw fires (the stream ends there)."""
        versions = np.asarray(versions, dtype=np.int64)
        key = prompt_key(prompt_ids)
        positions = np.arange(start_pos, start_pos + len(versions))
        ids, lps = self.tokens(key, sampling_seed, positions, versions)
        stop = np.flatnonzero(self.stops(self.profile(key, sampling_seed), positions, versions))
        if stop.size:
            end = int(stop[0]) + 1
            ids, lps = ids[:end], lps[:end]
            ids[-1] = self.eos_token_id
        return ids.tolist(), lps.tolist()

    def complete(self, prompt_ids: Sequence[int], sampling_seed: int, max_new_tokens: int,
                 version: int = 0) -> tuple[list[int], list[float], str]:
        """The uninterrupted response to ``prompt_ids`` under one version: (ids, logprobs, finish)."""
        ids, lps = self.reference(prompt_ids, sampling_seed, len(prompt_ids),
                                  np.full(max_new_tokens, version))
        finish = "stop" if ids and ids[-1] == self.eos_token_id else "length"
        return ids, lps, finish

    def response_length(self, prompt_ids: Sequence[int], sampling_seed: int, max_new_tokens: int,
                        version: int = 0) -> int:
        """Length of the uninterrupted response (including its EOS), without building tokens."""
        start = len(prompt_ids)
        end = self.first_stop(self.profile(prompt_key(prompt_ids), sampling_seed), start,
                              start + max_new_tokens, version)
        return max_new_tokens if end is None else end - start + 1


def reference_tokens(seed: int, prompt_ids: Sequence[int], sampling_seed: int, start_pos: int,
                     versions_per_token: Sequence[int], **model_kw: Any) -> tuple[list[int], list[float]]:
    """The deterministic stream an emulator with ``seed`` (and ``model_kw``: vocab_size,
    eos_token_id, logprob_scale, length) produces at ``start_pos...`` for the given per-token
    weight versions; ends with EOS if the stop draw fires inside the range."""
    return SyntheticLM(seed=seed, **model_kw).reference(prompt_ids, sampling_seed, start_pos,
                                                        versions_per_token)
