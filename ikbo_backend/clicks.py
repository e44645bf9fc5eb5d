"""Click data with a signal to learn: requests of the contract (requests.py) labelled by a planted teacher.

No click log can be downloaded here, so the data set is generated, the way synthetic.py draws requests but
shaped like traffic:
- ids follow Zipf laws, P(rank r) ∝ (r + 1)^-`zipf`, each table's ranks spread over its ids by a fixed
  permutation: a few ids are frequent enough to learn, most are rare;
- history lengths vary over [0, L] (the positions past them hold id 0), candidates per user are ragged
  (`synthetic.ragged_counts`) and `cand_to_user` is shuffled;
- labels [B, T] ~ Bernoulli(sigmoid(teacher logit)). The teacher is the same model family (IkboRanker) with
  its own seeded weights (`make_demo_weights(cfg, teacher_seed)`), its last layer rescaled so that each task's
  logit has mean `logit_mean` and standard deviation `logit_std` over a calibration sample: the labels carry
  a known, learnable signal, and the teacher's own AUC and log-loss on the held-out split are the ceiling
  a student can reach.

Request i of a data set is drawn from `np.random.default_rng([seed, i])` (its labels' uniforms from
`[seed, i, 1]`), so the data set is fixed by its seed: requests [0, train_requests) train, the next
`heldout_requests` form the held-out split. A batch (`ClickData.batch`) concatenates requests, their users
and mappings offset: the IKBO ops take any U, so a training step is fed several requests at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from .ranker import RankerConfig, make_demo_weights
from .requests import INPUT_NAMES
from .synthetic import ragged_counts, to_tensors
from .variants import build_ranker

CALIBRATION_SEED = 1 << 20  # request indices of the teacher's calibration sample start here (after any split)


def zipf_sampler(vocab_size: int, exponent: float, rng: np.random.Generator):
    """A function n → n ids in [0, vocab_size) with P(rank r) ∝ (r + 1)^-exponent, ranks mapped to ids by a
    permutation drawn from `rng`."""
    weights = np.arange(1, vocab_size + 1, dtype=np.float64) ** -exponent
    cdf = np.cumsum(weights / weights.sum())
    cdf[-1] = 1.0
    ids = rng.permutation(vocab_size)

    def sample(size, draw: np.random.Generator) -> np.ndarray:
        ranks = np.minimum(np.searchsorted(cdf, draw.random(size), side="right"), vocab_size - 1)
        return ids[ranks]

    return sample


def check_sizes(data, max_requests: int) -> None:
    """ValueError naming the field unless 1 ≤ users ≤ candidates and the two splits hold ≥ 1 and together
    ≤ `max_requests` requests (a data set's `users`, `candidates`, `train_requests`, `heldout_requests`)."""
    if not 1 <= data.users <= data.candidates:
        raise ValueError(f"users: expected in [1, candidates={data.candidates}], got {data.users}")
    if data.train_requests < 1 or data.heldout_requests < 1:
        raise ValueError(
            f"train_requests, heldout_requests: expected ≥ 1, got {data.train_requests}, {data.heldout_requests}"
        )
    if data.train_requests + data.heldout_requests > max_requests:
        raise ValueError(f"train_requests + heldout_requests: expected ≤ {max_requests}")


@dataclass(frozen=True)
class ClickData:
    """A seeded data set of requests of `users` users and `candidates` candidates; see the module doc."""

    cfg: RankerConfig
    users: int = 15  # U per request
    candidates: int = 1024  # B per request
    train_requests: int = 1 << 16
    heldout_requests: int = 32
    seed: int = 0
    zipf: float = 1.05

    reference: ClassVar[str] = "teacher"  # batches carry "teacher_logits"

    def __post_init__(self):
        check_sizes(self, CALIBRATION_SEED)
        if not self.zipf > 0:
            raise ValueError(f"zipf: expected an exponent > 0, got {self.zipf}")
        cfg, tables = self.cfg, np.random.default_rng([self.seed, CALIBRATION_SEED - 1])
        samplers = {
            "user_sparse_ids": zipf_sampler(cfg.user_vocab_size, self.zipf, tables),
            "cand_sparse_ids": zipf_sampler(cfg.cand_vocab_size, self.zipf, tables),
            "user_history_ids": zipf_sampler(cfg.item_vocab_size, self.zipf, tables),
        }
        object.__setattr__(self, "_samplers", samplers)

    def request(self, index: int) -> dict[str, np.ndarray]:
        """Request `index` of the data set (any index ≥ 0; the splits are ranges of them)."""
        cfg, draw = self.cfg, np.random.default_rng([self.seed, index])
        sample = self._samplers
        num_users, num_candidates = self.users, self.candidates
        counts = ragged_counts(num_users, num_candidates, draw)
        cand_to_user = draw.permutation(np.repeat(np.arange(num_users), counts)).astype(np.int32)
        history_len = draw.integers(0, cfg.history_length + 1, size=num_users).astype(np.int32)
        history_ids = sample["user_history_ids"]((num_users, cfg.history_length), draw)
        history_ids[np.arange(cfg.history_length)[None, :] >= history_len[:, None]] = 0  # padding
        return {
            "user_dense": draw.standard_normal((num_users, cfg.user_dense_features), dtype=np.float32),
            "user_sparse_ids": sample["user_sparse_ids"]((num_users, cfg.user_sparse_features), draw),
            "user_history_ids": history_ids,
            "user_history_len": history_len,
            "cand_dense": draw.standard_normal((num_candidates, cfg.cand_dense_features), dtype=np.float32),
            "cand_sparse_ids": sample["cand_sparse_ids"]((num_candidates, cfg.cand_sparse_features), draw),
            "cand_to_user": cand_to_user,
        }

    def uniforms(self, index: int) -> np.ndarray:
        """[B, T] uniforms of request `index`'s labels: label = uniform < teacher probability."""
        return np.random.default_rng([self.seed, index, 1]).random((self.candidates, self.cfg.tasks), np.float32)

    def train_indices(self, step: int, requests_per_step: int) -> list[int]:
        """The training requests of step `step` (0-based): consecutive, wrapping around the training split."""
        start = step * requests_per_step
        return [(start + i) % self.train_requests for i in range(requests_per_step)]

    def heldout_indices(self) -> list[int]:
        return list(range(self.train_requests, self.train_requests + self.heldout_requests))

    def batch(self, indices, teacher: Teacher, device="cpu") -> dict[str, torch.Tensor]:
        """Requests `indices` as one request (users and mappings offset) on `device`, with "labels" [B, T]
        float32 and the teacher's "teacher_logits" [B, T] (the teacher scores each request alone: a request's
        labels do not depend on the batch it is in)."""
        requests = [self.request(i) for i in indices]
        tensors = to_tensors(concatenate(requests), device)
        logits = torch.cat([teacher.logits(to_tensors(request, device)) for request in requests])
        uniforms = torch.from_numpy(np.concatenate([self.uniforms(i) for i in indices])).to(logits.device)
        tensors["labels"] = (uniforms < torch.sigmoid(logits)).float()
        tensors["teacher_logits"] = logits
        return tensors


def concatenate(requests: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Several requests as one: rows stacked, each request's `cand_to_user` offset by the users before it."""
    offsets = np.cumsum([0] + [len(r["user_dense"]) for r in requests[:-1]])
    merged = {name: np.concatenate([r[name] for r in requests]) for name in INPUT_NAMES if name != "cand_to_user"}
    merged["cand_to_user"] = np.concatenate(
        [r["cand_to_user"] + offset for r, offset in zip(requests, offsets)]
    ).astype(np.int32)
    return {name: merged[name] for name in INPUT_NAMES}


class Teacher:
    """The planted model that labels the data: IkboRanker in fp32 with weights `make_demo_weights(cfg, seed)`,
    its last layer rescaled so that each task's logit has mean `logit_mean` and standard deviation `logit_std`
    over `calibration_requests` requests of `data` (drawn past every split)."""

    def __init__(
        self,
        data: ClickData,
        seed: int = 1,
        logit_std: float = 2.0,
        logit_mean: float = -1.0,
        device="cpu",
        backend: str = "auto",
        calibration_requests: int = 8,
    ):
        if not logit_std > 0:
            raise ValueError(f"logit_std: expected > 0, got {logit_std}")
        self.cfg, self.device, self.backend = data.cfg, torch.device(device), backend
        self.weights = make_demo_weights(data.cfg, seed)
        self._build()
        indices = range(CALIBRATION_SEED, CALIBRATION_SEED + calibration_requests)
        raw = self.logits(to_tensors(concatenate([data.request(i) for i in indices]), self.device)).double()
        mean, std = raw.mean(dim=0).cpu(), raw.std(dim=0).clamp_min(1e-12).cpu()
        last = len(data.cfg.mlp_hidden)
        gain = logit_std / std  # [T]
        weight, bias = self.weights[f"mlp.{last}.weight"].double(), self.weights[f"mlp.{last}.bias"].double()
        self.weights[f"mlp.{last}.weight"] = (weight * gain[:, None]).float()
        self.weights[f"mlp.{last}.bias"] = ((bias - mean) * gain + logit_mean).float()
        self._build()

    def _build(self):
        self.features, self.interaction = build_ranker("ikbo", self.cfg, self.weights, self.device, self.backend)

    def logits(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T] fp32 logits of a request's tensors."""
        with torch.no_grad():  # not inference_mode: the labels made from these enter a loss's backward
            features = self.features(**{name: inputs[name] for name in INPUT_NAMES})
            return self.interaction.logits(features).float()
