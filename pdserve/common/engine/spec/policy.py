"""How many draft tokens each decoding sequence verifies this step (0: none), from what was
measured in this engine: each sequence's acceptance rate, and what a target step and a
draft pass cost by their number of query rows.

A step in which the sequences of a set S verify k_s drafts each yields, in expectation,
B + sum_S (E(beta_s, k_s) - 1) tokens (B: the batch's sequences that sample; E(beta, k) =
(1 - beta^(k+1)) / (1 - beta), the tokens a sequence keeps when each draft is accepted with
probability beta, independently) and costs T(R + sum_S k_s) + max k_s * D(|S|) seconds (T:
a target step of that many rows; D: a draft model's pass over |S| sequences, none for
n-gram lookup). The policy picks the S (sequences by acceptance, best first) and the k
that give the most tokens per second, none when nothing beats not speculating: on a
weight-bound single stream a few more rows cost little, in a compute-bound batch they
cost what they compute, and a draft that is mostly rejected costs its rows for nothing.
A sequence that has not verified anything for PROBE_EVERY steps verifies once, so its
estimate follows the text it is writing now; such probes are paid from a budget of
PROBE_SHARE of the steps' predicted time, so that in a batch whose rows cost what they
compute (where the probes' rows are not free) exploring costs at most that share.

Costs are measured in CPU seconds of the engine's thread (`time.thread_time`), not wall
time: on a host whose cores are shared, the time other processes take the cores away
varies by orders of magnitude between steps and says nothing about the step; the CPU time
a step keeps the engine's thread busy (its parallel regions included, where it works or
waits for its other threads) is what its rows cost."""
from __future__ import annotations

from dataclasses import dataclass

ACCEPT_DECAY = 0.9  # weight of a sequence's earlier verifications, per verification
POOLED_DECAY = 0.97  # the same over every sequence's verifications (what a new sequence starts from)
START_WEIGHT = 4.0  # verifications' worth of that pooled estimate a new sequence starts with
PROBE_EVERY = 16  # steps a sequence goes without speculating before it verifies once
PROBE_TOKENS = 2  # drafts such a probe verifies
PROBE_SHARE = 0.02  # of the steps' predicted time, what probes may cost at most


def expected_tokens(beta: float, k: int) -> float:
    """Tokens kept from k drafts, each accepted with probability beta (the first rejected
    ends them), counting the target's own token: (1 - beta^(k+1)) / (1 - beta)."""
    return float(k + 1) if beta >= 1.0 else (1.0 - beta ** (k + 1)) / (1.0 - beta)


class LinearCost:
    """The seconds of a pass of r query rows, a + b r: exponentially weighted least squares
    over the passes seen, its slope pulled toward the prior b / a = `slope_ratio` as if
    `prior_weight` rows-squared of spread said so (which decides it while the rows seen
    barely varied)."""

    def __init__(self, slope_ratio: float, decay: float = 0.98, prior_weight: float = 4.0) -> None:
        self.slope_ratio, self.decay, self.prior_weight = slope_ratio, decay, prior_weight
        self._w = self._r = self._y = self._rr = self._ry = 0.0  # decayed sums: 1, r, y, r^2, r y

    def observe(self, rows: int, seconds: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._r = self._r * d + rows
        self._y = self._y * d + seconds
        self._rr = self._rr * d + rows * rows
        self._ry = self._ry * d + rows * seconds

    @property
    def known(self) -> bool:
        return self._w > 0.0

    def fit(self) -> tuple[float, float]:
        """(a, b) in seconds and seconds per row; (0, 0) before any pass is seen."""
        if not self.known:
            return 0.0, 0.0
        r, y = self._r / self._w, self._y / self._w
        sxx, sxy = self._rr - self._w * r * r, self._ry - self._w * r * y
        prior = self.slope_ratio * y / (1.0 + self.slope_ratio * r)
        b = max(0.0, (sxy + self.prior_weight * prior) / (max(sxx, 0.0) + self.prior_weight))
        a = max(y - b * r, 0.05 * y)
        return a, b

    def predict(self, rows: int) -> float:
        a, b = self.fit()
        return a + b * rows


@dataclass
class Acceptance:
    """Decayed counts of accepted and rejected drafts (a Beta estimate of the chance the
    next draft is accepted, from a prior: a rejection ends a verification, so each counts
    the drafts kept and at most one refused), and the steps since the last verification."""

    accepted: float
    rejected: float
    decay: float = ACCEPT_DECAY
    idle: int = 0

    @property
    def beta(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.accepted = self.accepted * self.decay + num_accepted
        self.rejected = self.rejected * self.decay + (1 if num_accepted < num_draft else 0)
        self.idle = 0


class AdaptivePolicy:
    """Owns the step-cost models (the target's; a draft model's, when drafts cost passes)
    and each sequence's acceptance estimate."""

    def __init__(self, draft_passes: bool, draft_ratio: float = 0.0, prior: tuple[float, float] = (1.0, 1.0),
                 adaptive: bool = True) -> None:
        self.target = LinearCost(slope_ratio=0.1)
        self.draft = LinearCost(slope_ratio=0.1) if draft_passes else None
        self.draft_ratio = draft_ratio  # a draft pass's cost over a target step's, until one is measured
        self.pooled = Acceptance(*prior, decay=POOLED_DECAY)  # every sequence's verifications
        self.adaptive = adaptive
        self._seqs: dict[int, Acceptance] = {}
        self._probe_credit = 0.0  # seconds of predicted step time probes may still take

    def acceptance(self, seq_id: int) -> Acceptance:
        """A sequence's estimate; a new one starts from the pooled estimate (the same model
        and proposer on this engine's traffic), worth START_WEIGHT verifications."""
        a = self._seqs.get(seq_id)
        if a is None:
            beta = self.pooled.beta
            a = self._seqs[seq_id] = Acceptance(START_WEIGHT * beta, START_WEIGHT * (1.0 - beta))
        return a

    def release(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    def record(self, seq_id: int, num_draft: int, num_accepted: int) -> None:
        self.acceptance(seq_id).record(num_draft, num_accepted)
        self.pooled.record(num_draft, num_accepted)

    def choose(self, seq_ids: list[int], caps: list[int], base_rows: int, base_tokens: int) -> list[int]:
        """Drafts to verify for each candidate (at most caps[i]; 0: none) in a step that,
        without speculation, computes `base_rows` rows and samples `base_tokens` tokens."""
        if not self.adaptive or not self.target.known:  # the first step measures what speculation costs
            return list(caps)
        stats = [self.acceptance(i) for i in seq_ids]
        order = sorted((i for i in range(len(seq_ids)) if caps[i] > 0), key=lambda i: -stats[i].beta)
        a, b = self.target.fit()  # once: the loops below ask for it ~k x sequences times

        def step_s(rows: float) -> float:
            return a + b * rows
        t_base = step_s(base_rows)
        best_rate, best_k, best_m = base_tokens / t_base, 0, 0
        for k in range(1, max(caps, default=0) + 1):
            rows = tokens = 0.0
            for m, i in enumerate(order, 1):
                ki = min(k, caps[i])
                rows += ki
                tokens += expected_tokens(stats[i].beta, ki) - 1.0
                rate = (base_tokens + tokens) / (step_s(base_rows + int(rows)) + self._drafting(k, m))
                if rate > best_rate:
                    best_rate, best_k, best_m = rate, k, m
        chosen = set(order[:best_m])
        rows = base_rows + sum(min(best_k, caps[i]) for i in chosen)
        self._probe_credit = min(self._probe_credit + PROBE_SHARE * t_base, t_base)
        out = []
        for i, st in enumerate(stats):
            if i in chosen:
                out.append(min(best_k, caps[i]))
                continue
            k = min(PROBE_TOKENS, caps[i])
            cost = step_s(rows + k) - step_s(rows) if k else 0.0
            if k and st.idle + 1 >= PROBE_EVERY and cost <= self._probe_credit:
                st.idle = 0  # a probe: what does this text accept now?
                self._probe_credit -= cost
                rows += k
                out.append(k)
            else:
                st.idle += 1
                out.append(0)
        return out

    def _drafting(self, k: int, num_seqs: int) -> float:
        """Seconds of drafting k tokens for num_seqs sequences: k draft passes."""
        if self.draft is None:
            return 0.0
        per_pass = self.draft.predict(num_seqs) if self.draft.known else self.draft_ratio * self.target.predict(num_seqs)
        return k * per_pass
