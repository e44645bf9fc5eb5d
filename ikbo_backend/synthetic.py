"""Random requests of the contract (ikbo_backend/requests.py), for warm-up, tests, benchmarks and clients.

Every request drawn here is valid: ragged candidates per user, a shuffled `cand_to_user`, history
lengths anywhere in [0, L] with the positions past them padded with id 0.
"""

from __future__ import annotations

import numpy as np
import torch

from .ranker import RankerConfig


def ragged_counts(num_users: int, num_candidates: int, rng: np.random.Generator) -> np.ndarray:
    """Candidates per user, unequal (Dirichlet shares), summing to B; zeros are allowed."""
    shares = rng.dirichlet(np.full(num_users, 2.0))
    return rng.multinomial(num_candidates, shares)


def make_request(
    cfg: RankerConfig, num_users: int, num_candidates: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """A random valid request: ragged candidates per user, shuffled mapping, variable history lengths."""
    counts = ragged_counts(num_users, num_candidates, rng)
    cand_to_user = rng.permutation(np.repeat(np.arange(num_users), counts)).astype(np.int32)
    history_len = rng.integers(0, cfg.history_length + 1, size=num_users).astype(np.int32)
    history_ids = rng.integers(0, cfg.item_vocab_size, size=(num_users, cfg.history_length))
    history_ids[np.arange(cfg.history_length)[None, :] >= history_len[:, None]] = 0  # padding
    return {
        "user_dense": rng.standard_normal((num_users, cfg.user_dense_features)).astype(np.float32),
        "user_sparse_ids": rng.integers(0, cfg.user_vocab_size, size=(num_users, cfg.user_sparse_features)),
        "user_history_ids": history_ids.astype(np.int64),
        "user_history_len": history_len,
        "cand_dense": rng.standard_normal((num_candidates, cfg.cand_dense_features)).astype(np.float32),
        "cand_sparse_ids": rng.integers(0, cfg.cand_vocab_size, size=(num_candidates, cfg.cand_sparse_features)),
        "cand_to_user": cand_to_user,
    }


def make_online_batch(
    cfg: RankerConfig, num_users: int, num_candidates: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """A random batch request (`make_request`) in which every user has at least one candidate (B ≥ U),
    so that `online.split_by_user` of it gives U valid online requests of B/U candidates on average."""
    if not 1 <= num_users <= num_candidates:
        raise ValueError(f"num_users: expected in [1, B={num_candidates}], got {num_users}")
    request = make_request(cfg, num_users, num_candidates, rng)
    counts = 1 + rng.multinomial(num_candidates - num_users, np.full(num_users, 1 / num_users))
    request["cand_to_user"] = rng.permutation(np.repeat(np.arange(num_users), counts)).astype(np.int32)
    return request


def to_tensors(request: dict[str, np.ndarray], device="cpu") -> dict[str, torch.Tensor]:
    """A request of numpy arrays as torch tensors on `device` (on the host, contiguous arrays are not copied)."""
    return {name: torch.from_numpy(np.ascontiguousarray(array)).to(device) for name, array in request.items()}
