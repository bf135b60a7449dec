"""An engine's step time, from a profile measured on the hardware (`python bench/engine_profile.py`; stored as data in
bench/results/profile-*.json, never as code).

One step of continuous batching computes the prefill chunks of some requests and one token of each decoding one; its
time is modelled as

    step_s = base_s + prefill_token_s × prefill tokens + decode_seq_s × decoding requests
             + context_ktoken_s × (KV tokens the batch attends to) / 1000

fitted by least squares to the measured steps (`fit`). The profile also carries what the engine it was measured on
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
    about: str = ""
    samples: list[dict] = field(default_factory=list)

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
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


def fit_error(profile: StepProfile, samples: list[dict]) -> float:
    """Median relative error of the fitted step time over the samples."""
    errs = sorted(
        abs(profile.step_s(s["prefill_tokens"], s["decode_seqs"], s["context_tokens"]) - s["step_s"]) / s["step_s"]
        for s in samples
        if s["step_s"] > 0
    )
    return errs[len(errs) // 2] if errs else 0.0
