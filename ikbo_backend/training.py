"""Training the ranker: either variant ("ikbo" or "baseline") of ranker.py as an nn.Module over trainable
Parameters, AdamW on click data with a planted teacher (clicks.py) or on MovieLens-100k (movielens.py), held-out
evaluation, checkpoints, and a weights file that `make serve` loads.

`RankerModule` builds the feature stage and the interaction of ranker.py once, over nn.Parameters: every call
reads the Parameters, so an optimizer step (in place) reaches the next call. The IKBO interaction trains its LCE
through `PackedLinearCompress`'s own Parameters (its padded-weight cache follows their version counters) and its
first MLP layer through views of mlp.0.weight; `served_weights()` puts the LCE back together as lce.weight and
lce.bias, the layout of `ranker.save_weights`. Both variants compute the same function from the same weights, so
from the same initial weights on the same batches they follow the same loss curve; the IKBO one never builds a
user tensor at B rows, forward or backward (tests/test_training.py).

`train(TrainConfig)` runs the loop (scripts/train.py, `make train`): a step is `requests_per_step` requests of
the training split concatenated, the loss the mean binary cross-entropy over the B × T click labels, bf16
autocast on a GPU (fp32 Parameters and optimizer state), a tqdm progress bar, held-out AUC and log-loss every
`eval_every` steps beside the data's reference (`reference_metrics`: the teacher's, or item popularity's), a
checkpoint (model, optimizer, step, history) at each evaluation, resumed with `resume=True`; at the end the weights
file (RankerConfig in its metadata), the metrics as JSON and a PNG of the curves.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .clicks import ClickData, Teacher
from .movielens import MovieLensData
from .paths import REPO_ROOT, profile_weights_path
from .ranker import PROFILES, BaselineRanker, FeatureStage, IkboRanker, RankerConfig, make_demo_weights, save_weights
from .requests import INPUT_NAMES

VARIANTS = ("ikbo", "baseline")
DATA = {"clicks": ClickData, "movielens": MovieLensData}  # TrainConfig.source
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LCE_WEIGHTS = ("lce.weight", "lce.bias")


class RankerModule(nn.Module):
    """One ranker variant as an nn.Module: forward(inputs) → logits [B, T] for a request's tensors (the contract of
    requests.py, by name; float inputs cast to `dtype`). Parameters start as copies of `weights` (the
    `ranker.weight_shapes` layout) in `dtype` (fp32; fp64 for references) on `device`."""

    def __init__(
        self,
        variant: str,
        cfg: RankerConfig,
        weights: dict[str, torch.Tensor],
        device="cpu",
        backend: str = "auto",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
        self.variant, self.cfg, self.dtype = variant, cfg, dtype
        params = {
            name: nn.Parameter(t.detach().to(device=device, dtype=dtype, copy=True)) for name, t in weights.items()
        }
        self.features = FeatureStage(cfg, params, device)
        if variant == "ikbo":
            self.interaction = IkboRanker(cfg, params, device, backend)
            self.lce = self.interaction.lce  # trains its own copies of lce.weight's column blocks and lce.bias
            params = {name: p for name, p in params.items() if name not in LCE_WEIGHTS}
        else:
            self.interaction = BaselineRanker(cfg, params, device)
        self._names = {name.replace(".", "__"): name for name in params}  # ParameterDict keys take no dots
        self.weights = nn.ParameterDict({key: params[name] for key, name in self._names.items()})

    def forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        request = {
            name: inputs[name].to(self.dtype) if inputs[name].is_floating_point() else inputs[name]
            for name in INPUT_NAMES
        }
        return self.interaction.logits(self.features(**request))

    def _layout(self, of) -> dict[str, torch.Tensor]:
        tensors = {name: of(self.weights[key]) for key, name in self._names.items()}
        if self.variant == "ikbo":
            user, cand, bias = (of(p) for p in (self.lce.user_weight, self.lce.cand_weight, self.lce.bias))
            if user is not None and cand is not None:
                tensors["lce.weight"] = torch.cat([user, cand], dim=1)
            if bias is not None:
                tensors["lce.bias"] = bias
        return {name: t for name, t in tensors.items() if t is not None}

    def served_weights(self) -> dict[str, torch.Tensor]:
        """The Parameters in the served layout (`ranker.weight_shapes` names), fp32 copies on the host."""
        return {name: t.detach().float().cpu().clone() for name, t in self._layout(lambda p: p).items()}

    def gradients(self) -> dict[str, torch.Tensor]:
        """The Parameters' gradients in the served layout (names without a gradient left out)."""
        return {name: t.detach() for name, t in self._layout(lambda p: p.grad).items()}


def click_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean binary cross-entropy over the B × T labels, in fp32 at least (16-bit logits are widened)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.binary_cross_entropy_with_logits(logits.to(dtype), labels.to(dtype))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """Area under the ROC curve of one task (Mann–Whitney, ties at half); NaN without both classes."""
    scores, labels = np.asarray(scores, np.float64).ravel(), np.asarray(labels).ravel() > 0.5
    positives, negatives = int(labels.sum()), int((~labels).sum())
    if positives == 0 or negatives == 0:
        return math.nan
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    mean_rank = np.cumsum(counts) - (counts - 1) / 2  # 1-based rank of each distinct score, ties averaged
    rank_sum = mean_rank[inverse][labels].sum()
    return float((rank_sum - positives * (positives + 1) / 2) / (positives * negatives))


def click_metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC (mean over tasks) and log-loss of logits [rows, T] against labels [rows, T]."""
    logits, labels = logits.float().cpu(), labels.float().cpu()
    tasks = [auc(logits[:, t].numpy(), labels[:, t].numpy()) for t in range(labels.shape[1])]
    return {"auc": float(np.nanmean(tasks)), "logloss": float(click_loss(logits, labels))}


def reference_metrics(reference: str, batches: list[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Held-out metrics of the data's reference scores (the batches' f"{reference}_logits"): the teacher's AUC and
    log-loss (clicks.py: the ceiling), or item popularity's AUC (movielens.py: a baseline; its scores are log
    counts, not probabilities, so no log-loss)."""
    logits = torch.cat([b[f"{reference}_logits"] for b in batches])
    metrics = click_metrics(logits, torch.cat([b["labels"] for b in batches]))
    return metrics if reference == "teacher" else {"auc": metrics["auc"]}


def autocast(device: torch.device, dtype: torch.dtype):
    """bf16 autocast where `dtype` asks for it, else a no-op context."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over every Parameter, fused (one pass per tensor: on the CPU 4.5× faster than the per-op update,
    which spends most of an IKBO step updating the embedding tables)."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=True)


def train_step(model: RankerModule, optimizer, batch: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """One AdamW step on a batch (forward under `dtype` autocast, fp32 loss); returns the loss, on the device
    (reading it waits for the step)."""
    optimizer.zero_grad(set_to_none=True)
    device = batch["labels"].device
    with autocast(device, dtype):
        logits = model(batch)
    loss = click_loss(logits, batch["labels"])
    loss.backward()
    optimizer.step()
    return loss.detach()


# (steps, requests a step) when not given: about a minute on the 2-core CPU machine (visibly learning); on a GPU
# about 4 minutes on an H200, after which held-out AUC is within 0.02 of the teacher's (docs/results.md, Training)
DEFAULT_LENGTH = {"cpu": (400, 2), "cuda": (4000, 8)}


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Paths relative to the project root; `weights` None: the file `make serve` loads for
    the profile (paths.profile_weights_path). Model dims: PROFILES[profile] unless `Trainer` is given others."""

    profile: str = "demo"
    variant: str = "ikbo"
    source: str = "clicks"  # the data: a key of DATA
    steps: int | None = None  # None: DEFAULT_LENGTH of the device
    requests_per_step: int | None = None
    users: int = 15  # U per request
    candidates: int = 1024  # B per request
    lr: float = 3e-3
    final_lr: float = 0.1  # of lr: cosine decay from lr to final_lr·lr over `steps` (1.0: constant)
    weight_decay: float = 0.01
    eval_every: int = 50
    heldout_requests: int = 16
    train_requests: int = 1 << 16
    seed: int = 0  # data
    teacher_seed: int = 1  # clicks only
    init_seed: int = 2  # the student's initial weights
    device: str = "auto"  # cuda when there is one, else cpu
    dtype: str = "auto"  # autocast dtype: bfloat16 on a GPU, float32 on the CPU
    backend: str = "auto"
    threads: int = 0  # torch's CPU threads; 0: torch's choice (one per core)
    weights: str | None = None
    out: str = "out/train"  # checkpoint.pt, metrics.json, curves.png
    resume: bool = False
    progress: bool = True

    def __post_init__(self):
        length = DEFAULT_LENGTH.get(self.torch_device().type, DEFAULT_LENGTH["cpu"])
        if self.steps is None:
            object.__setattr__(self, "steps", length[0])
        if self.requests_per_step is None:
            object.__setattr__(self, "requests_per_step", length[1])
        if self.profile not in PROFILES:
            raise ValueError(f"profile: expected one of {sorted(PROFILES)}, got {self.profile!r}")
        if self.variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {VARIANTS}, got {self.variant!r}")
        if self.source not in DATA:
            raise ValueError(f"source: expected one of {sorted(DATA)}, got {self.source!r}")
        for name in ("steps", "requests_per_step", "users", "candidates", "eval_every", "heldout_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected an integer ≥ 1, got {getattr(self, name)}")
        if self.threads < 0:
            raise ValueError(f"threads: expected an integer ≥ 0 (0: torch's choice), got {self.threads}")
        if self.users > self.candidates:
            raise ValueError(f"users: expected ≤ candidates ({self.candidates}) per request, got {self.users}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: expected a finite value > 0, got {self.lr}")
        if not (math.isfinite(self.final_lr) and 0 <= self.final_lr <= 1):
            raise ValueError(f"final_lr: expected a fraction of lr in [0, 1], got {self.final_lr}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(f"weight_decay: expected a finite value ≥ 0, got {self.weight_decay}")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype: expected auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.backend not in ("auto", "torch", "triton"):
            raise ValueError(f"backend: expected auto, torch or triton, got {self.backend!r}")
        device = self.torch_device()
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device: {self.device!r} asked for, but torch sees no CUDA device")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device: expected auto, cpu or cuda[:i], got {self.device!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): cosine from lr down to final_lr·lr at `steps`. A
        function of the step alone, so a resumed run continues the schedule (on its own `steps`)."""
        progress = min(step / self.steps, 1.0)
        return self.lr * (self.final_lr + (1 - self.final_lr) * 0.5 * (1 + math.cos(math.pi * progress)))

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        try:
            return torch.device(self.device)
        except RuntimeError as error:
            raise ValueError(f"device: expected auto, cpu or cuda[:i], got {self.device!r}") from error

    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device().type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def weights_path(self) -> Path:
        return REPO_ROOT / self.weights if self.weights else profile_weights_path(self.profile)

    def out_dir(self) -> Path:
        return REPO_ROOT / self.out

    def data(self, cfg: RankerConfig | None = None) -> ClickData | MovieLensData:
        return DATA[self.source](
            cfg or PROFILES[self.profile],
            self.users,
            self.candidates,
            self.train_requests,
            self.heldout_requests,
            self.seed,
        )

    def run_key(self) -> dict:
        """The fields a resumed run must share with its checkpoint (all but the length, paths and display)."""
        ignored = {"steps", "weights", "out", "resume", "progress", "eval_every", "threads"}
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in ignored}


def _write_atomic(path: Path, write) -> None:
    """write(temp path) then rename, so a reader never sees half a file (a server may load it meanwhile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


class Trainer:
    """The state of one run (model, optimizer, data, teacher (clicks only, else None), held-out batches, history);
    `train` drives it. `cfg`: model dims other than the profile's (tests)."""

    def __init__(self, config: TrainConfig, cfg: RankerConfig | None = None):
        self.config = config
        self.device, self.dtype = config.torch_device(), config.torch_dtype()
        self.data = config.data(cfg)
        self.cfg = self.data.cfg
        self.teacher = None
        if isinstance(self.data, ClickData):
            self.teacher = Teacher(self.data, config.teacher_seed, device=self.device, backend=config.backend)
        initial = make_demo_weights(self.cfg, config.init_seed)
        self.model = RankerModule(config.variant, self.cfg, initial, self.device, config.backend)
        self.optimizer = make_optimizer(self.model, config.lr, config.weight_decay)
        self.step = 0
        self.history: dict[str, list] = {"step": [], "loss": [], "eval": []}
        indices = self.data.heldout_indices()
        chunks = [indices[i : i + config.requests_per_step] for i in range(0, len(indices), config.requests_per_step)]
        self.heldout = [self.data.batch(chunk, self.teacher, self.device) for chunk in chunks]
        self.reference = {"name": self.data.reference, **reference_metrics(self.data.reference, self.heldout)}

    def train_step(self, batch: dict[str, torch.Tensor]) -> float:
        """One AdamW step on a batch; returns its loss."""
        return float(train_step(self.model, self.optimizer, batch, self.dtype))

    def evaluate(self) -> dict[str, float]:
        """Held-out AUC and log-loss of the model now."""
        with torch.no_grad(), autocast(self.device, self.dtype):
            logits = torch.cat([self.model(batch).float() for batch in self.heldout])
        return click_metrics(logits, torch.cat([b["labels"] for b in self.heldout]))

    def checkpoint_path(self) -> Path:
        return self.config.out_dir() / "checkpoint.pt"

    def save_checkpoint(self) -> None:
        state = {
            "run": self.run_key(),
            "step": self.step,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "history": self.history,
        }
        _write_atomic(self.checkpoint_path(), lambda tmp: torch.save(state, tmp))

    def load_checkpoint(self) -> None:
        path = self.checkpoint_path()
        if not path.exists():
            raise FileNotFoundError(f"resume: no checkpoint at {path}")
        state = torch.load(path, map_location=self.device, weights_only=True)
        if state["run"] != self.run_key():
            keys = state["run"].keys() | self.run_key().keys()
            changed = sorted(k for k in keys if state["run"].get(k) != self.run_key().get(k))
            raise ValueError(f"resume: {path} is a checkpoint of another run (differs in {', '.join(changed)})")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.history = state["step"], state["history"]

    def run_key(self) -> dict:
        return {**self.config.run_key(), "model": dataclasses.asdict(self.cfg)}

    def record_eval(self) -> dict[str, float]:
        metrics = self.evaluate()
        self.history["eval"].append({"step": self.step, **metrics})
        return metrics

    def write_outputs(self, seconds: float) -> dict:
        """The weights file, metrics.json and curves.png; returns the metrics."""
        config, out = self.config, self.config.out_dir()
        weights = self.model.served_weights()
        _write_atomic(config.weights_path(), lambda tmp: save_weights(tmp, self.cfg, weights))
        summary = {
            "config": dataclasses.asdict(config),
            "device": str(self.device),
            "autocast": str(self.dtype).replace("torch.", ""),
            "steps": self.step,
            "seconds": seconds,
            "candidates_per_step": config.requests_per_step * config.candidates,
            "heldout_candidates": sum(len(b["labels"]) for b in self.heldout),
            "final": self.history["eval"][-1],
            "reference": self.reference,
            "history": self.history,
            "weights": str(config.weights_path()),
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / "metrics.json").write_text(json.dumps(summary, indent=1))
        title = f"{config.variant}, {config.profile}, {config.source}"
        plot_curves(self.history, self.reference, out / "curves.png", title)
        return summary


def train(config: TrainConfig, cfg: RankerConfig | None = None) -> dict:
    """Run (or resume) a training run to `config.steps` steps; returns the summary written to metrics.json. With
    `progress` a tqdm bar, else a line per evaluation."""
    import matplotlib  # noqa: F401  (plot_curves needs it: an ImportError now, not after the run)

    started = time.perf_counter()
    if config.threads:
        torch.set_num_threads(config.threads)
    trainer = Trainer(config, cfg)
    if config.resume:
        trainer.load_checkpoint()
    if not trainer.history["eval"]:
        trainer.record_eval()  # the initial weights' metrics: the curves start at step 0
    data, per_step = trainer.data, config.requests_per_step
    bar = None
    if config.progress:
        from tqdm import tqdm

        bar = tqdm(total=config.steps, initial=trainer.step, unit="step", desc=config.source, dynamic_ncols=True)
    reference = trainer.reference
    shown = {"auc": f"{trainer.history['eval'][-1]['auc']:.4f}", reference["name"]: f"{reference['auc']:.4f}"}
    while trainer.step < config.steps:
        batch = data.batch(data.train_indices(trainer.step, per_step), trainer.teacher, trainer.device)
        for group in trainer.optimizer.param_groups:
            group["lr"] = config.lr_at(trainer.step)
        loss = trainer.train_step(batch)
        trainer.step += 1
        trainer.history["step"].append(trainer.step)
        trainer.history["loss"].append(loss)
        if trainer.step % config.eval_every == 0 or trainer.step == config.steps:
            metrics = trainer.record_eval()
            trainer.save_checkpoint()
            shown["auc"] = f"{metrics['auc']:.4f}"
            if bar is None:
                print(
                    f"{config.source} step {trainer.step}: loss {loss:.4f}, {held_out(metrics, reference)}, "
                    f"{time.perf_counter() - started:.0f} s",
                    flush=True,
                )
        if bar is not None:
            bar.set_postfix({"loss": f"{loss:.4f}", **shown}, refresh=False)
            bar.update(1)
    if bar is not None:
        bar.close()
    return trainer.write_outputs(time.perf_counter() - started)


def held_out(metrics: dict[str, float], reference: dict) -> str:
    """The held-out metrics beside the reference's, as printed (the reference's log-loss where it has one)."""
    name = reference["name"]
    logloss = f" ({name} {reference['logloss']:.4f})" if "logloss" in reference else ""
    return (
        f"held-out AUC {metrics['auc']:.4f} ({name} {reference['auc']:.4f}), log-loss {metrics['logloss']:.4f}{logloss}"
    )


def plot_curves(history: dict, reference: dict, path: Path, title: str) -> None:
    """Training loss (and its running mean) and held-out AUC and log-loss against steps, the reference's (teacher
    or popularity: `Trainer.reference`) as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    steps, losses = np.array(history["step"]), np.array(history["loss"])
    evals = history["eval"]
    eval_steps = [e["step"] for e in evals]
    if len(losses):
        left.plot(steps, losses, lw=0.6, alpha=0.4, label="training loss")
        window = max(1, len(losses) // 20)
        left.plot(steps[window - 1 :], np.convolve(losses, np.ones(window) / window, "valid"), label="running mean")
    left.plot(eval_steps, [e["logloss"] for e in evals], "o-", ms=3, label="held-out log-loss")
    if "logloss" in reference:
        left.axhline(reference["logloss"], color="k", ls="--", lw=1, label=f"{reference['name']} held-out log-loss")
    left.set_xlabel("step")
    left.set_ylabel("binary cross-entropy")
    left.legend()
    right.plot(eval_steps, [e["auc"] for e in evals], "o-", ms=3, label="held-out AUC")
    right.axhline(reference["auc"], color="k", ls="--", lw=1, label=f"{reference['name']} AUC")
    right.axhline(0.5, color="grey", ls=":", lw=1)
    right.set_xlabel("step")
    right.set_ylabel("AUC (mean over tasks)")
    right.legend(loc="lower right")
    fig.suptitle(f"Training the ranker ({title})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
