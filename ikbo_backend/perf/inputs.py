"""perf_analyzer `--input-data` files for several U:B mixes, drawn with the tests' request generator.

Each file perf_configs/<mix>.json holds a few requests drawn with `ikbo_backend.requests.make_request`
(seeded per mix, so the files are reproducible):

    {"data": [{"user_dense": {"content": [...row-major...], "shape": [U, Fu]}, ...}, ...]}

perf_analyzer sends the requests in turn, each with its own shapes (the rankers have
`max_batch_size: 0`, so the shapes are the whole request). FP32 values are rounded to 4 decimals and
always written with a decimal point (perf_analyzer rejects `1` as float data).

Online endpoints (ikbo_ranker_online, baseline_ranker_online): perf_configs/<mix>.online.json holds
the same mix as U one-user requests of B/U candidates on average (`online_perf_data`; shapes without
the request dimension, which perf_analyzer adds with its batch size 1).
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

import numpy as np

from ..online import ONLINE_INPUT_NAMES, split_by_user
from ..ranker import RankerConfig
from ..requests import INPUT_NAMES, input_widths
from ..synthetic import make_online_batch, make_request

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = ROOT / "perf_configs"
REQUESTS_PER_FILE = 4
# name → (U users, B candidates) per request
MIXES: dict[str, tuple[int, int]] = {
    "u1_b1": (1, 1),
    "u1_b64": (1, 64),
    "u64_b64": (64, 64),
    "u4_b256": (4, 256),
    "u1_b1024": (1, 1024),
    "u15_b1024": (15, 1024),
}


def mix_shape(name: str) -> tuple[int, int]:
    if name not in MIXES:
        raise ValueError(f"mix: expected one of {', '.join(MIXES)}, got {name!r}")
    return MIXES[name]


def _content(array: np.ndarray) -> list:
    """Flattened values; floats rounded to 4 decimals (json writes Python floats with a '.')."""
    if array.dtype.kind == "f":
        return np.round(array.astype(np.float64), 4).ravel().tolist()
    return array.ravel().tolist()


def perf_data(cfg: RankerConfig, name: str, num_requests: int = REQUESTS_PER_FILE, seed: int = 0) -> dict:
    """The --input-data document for one mix: `num_requests` requests from make_request."""
    num_users, num_candidates = mix_shape(name)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    data = []
    for _ in range(num_requests):
        request = make_request(cfg, num_users, num_candidates, rng)
        data.append({k: {"content": _content(request[k]), "shape": list(request[k].shape)} for k in INPUT_NAMES})
    return {"data": data}


def online_perf_data(cfg: RankerConfig, name: str, num_batches: int = REQUESTS_PER_FILE, seed: int = 0) -> dict:
    """The --input-data document of the online endpoints for one mix: `num_batches` batches of U
    users and B candidates (every user at least one), each sent as U one-user requests."""
    num_users, num_candidates = mix_shape(name)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), 1])
    data = []
    for _ in range(num_batches):
        for one in split_by_user(make_online_batch(cfg, num_users, num_candidates, rng)):
            data.append({k: {"content": _content(one[k]), "shape": list(one[k].shape[1:])} for k in ONLINE_INPUT_NAMES})
    return {"data": data}


def candidates_per_request(path: Path) -> float:
    """Mean candidates per request of an --input-data file (rows of cand_dense)."""
    data = json.loads(Path(path).read_text())["data"]
    return sum(step["cand_dense"]["shape"][0] for step in data) / len(data)


def _write_json(path: Path, document: dict) -> Path:
    """Write `document` to `path` atomically: a concurrent reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, separators=(",", ":")))
    tmp.replace(path)
    return path


def _first_shapes(path: Path) -> dict[str, list[int]] | None:
    """Input name → shape of the first request in an --input-data file; None when missing or unreadable."""
    try:
        return {k: v["shape"] for k, v in json.loads(path.read_text())["data"][0].items()}
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def ensure_online_config(name: str, out_dir=DEFAULT_DIR, cfg: RankerConfig | None = None) -> Path:
    """Path of <out_dir>/<name>.online.json, (re)written when missing or drawn for other model dims."""
    cfg = cfg or RankerConfig()
    path = Path(out_dir) / f"{name}.online.json"
    widths = input_widths(cfg)
    expected = {k: [1] if widths[k] is None else [widths[k]] for k in ONLINE_INPUT_NAMES}
    expected.update({k: [-1, widths[k]] for k in ("cand_dense", "cand_sparse_ids")})
    shapes = _first_shapes(path)
    if shapes is not None and {k: [-1, *v[1:]] if k.startswith("cand") else v for k, v in shapes.items()} == expected:
        return path
    return _write_json(path, online_perf_data(cfg, name))


def write_config(
    name: str,
    out_dir=DEFAULT_DIR,
    num_requests: int = REQUESTS_PER_FILE,
    seed: int = 0,
    cfg: RankerConfig | None = None,
) -> Path:
    """Write <out_dir>/<name>.json: `num_requests` requests of the mix (perf_data)."""
    return _write_json(Path(out_dir) / f"{name}.json", perf_data(cfg or RankerConfig(), name, num_requests, seed))


def _expected_shapes(cfg: RankerConfig, name: str) -> dict[str, list[int]]:
    rows = dict(zip(("user", "cand"), mix_shape(name)))
    return {k: [rows[k.split("_")[0]]] + ([] if w is None else [w]) for k, w in input_widths(cfg).items()}


def ensure_config(name: str, out_dir=DEFAULT_DIR, cfg: RankerConfig | None = None) -> Path:
    """Path of <out_dir>/<name>.json, (re)written when missing or drawn for other model dims.

    The files are generated, not kept in git: the perf tools and tests call this first.
    """
    cfg = cfg or RankerConfig()
    path = Path(out_dir) / f"{name}.json"
    if _first_shapes(path) == _expected_shapes(cfg, name):
        return path
    return write_config(name, out_dir, cfg=cfg)
