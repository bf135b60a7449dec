"""An engine's step time, from a profile measured on the hardware (`python bench/engine_profile.py`; stored as data in
bench/results/profile-*.json, never as code).

One step of continuous batching computes the prefill chunks of some requests and one token of each decoding one; its
time is modelled as

    step_s = base_s + prefill_token_s × prefill tokens + decode_seq_s × decoding requests
             + context_ktoken_s × (KV tokens the batch attends to) / 1000

fitted by least squares to the measured steps (`fit`), each step timed alone (vLLM's async scheduling off). A served
engine schedules asynchronously (the next step is prepared on the CPU while the GPU runs this one), which hides part of
each step's CPU time: where the profile also measured decode runs with async scheduling on, the hidden part is fitted
as `async_gain_s + async_gain_seq_s × decoding requests` and taken off every step (`async_scheduling`, on by default
as in vLLM's engine). The profile also carries what the engine it was measured on
had (block size, KV capacity, batch limits), which the simulator uses unless the YAML says otherwise.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

TERMS = ("base_s", "prefill_token_s", "decode_seq_s", "context_ktoken_s")


@dataclass
class StepProfile:
    name: str
    base_s: float
    prefill_token_s: float
    decode_seq_s: float
    context_ktoken_s: float = 0.0
    block_size: int = 16
    kv_tokens: int | None = None  # the measured engine's KV cache, in tokens
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    start_s: float = 60.0  # a replica's cold start: scheduling, weights, profiling, warm-up
    wake_s: float = 1.0  # a sleeping replica's wake (sleep mode)
    async_gain_s: float = 0.0  # the step time async scheduling hides (fitted to decode runs measured with it on)
    async_gain_seq_s: float = 0.0
    async_scheduling: bool = True  # the simulated engines schedule asynchronously (the gain above applies)
    about: str = ""
    samples: list[dict] = field(default_factory=list)

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        alone = self.sync_step_s(prefill_tokens, decode_seqs, context_tokens)
        if not self.async_scheduling:
            return alone
        # never below half the step alone: the gain is CPU work hidden behind the GPU's, a share of the step
        return max(alone - self.async_gain_s - self.async_gain_seq_s * decode_seqs, alone / 2)

    def sync_step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        """The step timed alone, as the fit measured it."""
        return (
            self.base_s
            + self.prefill_token_s * prefill_tokens
            + self.decode_seq_s * decode_seqs
            + self.context_ktoken_s * context_tokens / 1000
        )

    @classmethod
    def load(cls, path: str | Path) -> StepProfile:
        data = json.loads(Path(path).read_text())
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2) + "\n")


def fit(samples: list[dict]) -> dict[str, float]:
    """Least-squares coefficients of TERMS from measured steps: each sample {prefill_tokens, decode_seqs,
    context_tokens, step_s}. Coefficients are kept non-negative (a term the data cannot see is 0)."""
    import numpy as np

    rows = np.array(
        [[1.0, s["prefill_tokens"], s["decode_seqs"], s["context_tokens"] / 1000] for s in samples], dtype=float
    )
    times = np.array([s["step_s"] for s in samples], dtype=float)
    active = list(range(len(TERMS)))
    while True:
        coef, *_ = np.linalg.lstsq(rows[:, active], times, rcond=None)
        negative = [active[i] for i, c in enumerate(coef) if c < 0]
        if not negative:
            break
        active = [a for a in active if a not in negative]
    out = dict.fromkeys(TERMS, 0.0)
    for i, c in zip(active, coef):
        out[TERMS[i]] = float(c)
    return out


def fit_async_gain(profile: StepProfile, samples: list[dict]) -> tuple[float, float]:
    """(async_gain_s, async_gain_seq_s): how much shorter decode steps ran with async scheduling on than the fit of
    the steps timed alone says, by least squares on (1, decoding requests); each coefficient kept non-negative."""
    import numpy as np

    if not samples:
        return 0.0, 0.0
    rows = np.array([[1.0, s["decode_seqs"]] for s in samples], dtype=float)
    gains = np.array(
        [profile.sync_step_s(0, s["decode_seqs"], s["context_tokens"]) - s["step_s"] for s in samples], dtype=float
    )
    coef, *_ = np.linalg.lstsq(rows, gains, rcond=None)
    if coef[1] < 0:
        coef = [max(0.0, float(np.mean(gains))), 0.0]
    elif coef[0] < 0:
        coef = [0.0, max(0.0, float(np.dot(rows[:, 1], gains) / np.dot(rows[:, 1], rows[:, 1])))]
    return float(coef[0]), float(coef[1])


def fit_error(profile: StepProfile, samples: list[dict], timed_alone: bool = True) -> float:
    """Median relative error of the fitted step time over the samples (`timed_alone`: the sync fit, else the step
    time with async scheduling's gain taken off)."""
    of = profile.sync_step_s if timed_alone else profile.step_s
    errs = sorted(
        abs(of(s["prefill_tokens"], s["decode_seqs"], s["context_tokens"]) - s["step_s"]) / s["step_s"]
        for s in samples
        if s["step_s"] > 0
    )
    return errs[len(errs) // 2] if errs else 0.0
