"""A drafter run's training state, beside its published checkpoint: what ``--resume`` needs to
continue the same run where it stopped. ``config.json`` and ``model.safetensors`` stay in their
dialect (z-lab DFlash, speculators EAGLE-3, ...); the rest goes in ``training_state.pt``:
float32 weights (the published copy is bf16), the optimizer's moments, the step and schedule
position, the data order's generator, and the distilled text itself (regenerating it would
redo the run's most expensive phase, and a budget that cut generation short would not give
the same rows again)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..models.config import ConfigError
from ..models.target import TargetModel

STATE_FILE = "training_state.pt"
FORMAT = 1
# Knobs a resumed run may change: how long it goes on and how often it evaluates. Every other
# one shapes the run itself (its data, objective, model or schedule): a change is another run.
MAY_CHANGE = frozenset({"steps", "max_seconds", "eval_every"})


@dataclass(frozen=True)
class Position:
    """Where a training loop stands: steps done, and the schedule's time-based progress (0 in a
    run without --max-seconds; otherwise how far its budget had decayed the learning rate)."""

    step: int = 0
    time_progress: float = 0.0


def target_identity(target: TargetModel) -> dict[str, Any]:
    """What names a target for a resume: its shape, and a checksum of its embedding (the same
    shape with other weights is another target)."""
    return {"config": dataclasses.asdict(target.config),
            "embed_sum": float(target.model.embed_tokens.weight.detach().double().sum())}


class StateWriter:
    """Writes ``training_state.pt`` into ``folder`` at each checkpoint of one run."""

    def __init__(self, folder: Path, method: str, config: Any, target: TargetModel, data: dict[str, Tensor]):
        self.path = Path(folder) / STATE_FILE
        self.run = {"method": method, "config": dataclasses.asdict(config), "target": target_identity(target)}
        self.data = {k: v.detach().cpu() for k, v in data.items()}

    def save(self, pos: Position, model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> None:
        state = {"format": FORMAT, "run": self.run, "step": pos.step, "time_progress": pos.time_progress,
                 "weights": {k: v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu()
                             for k, v in model.state_dict().items()},
                 "optimizer": opt.state_dict(), "generator": gen.get_state(), "torch_rng": torch.get_rng_state(),
                 "data": self.data}
        tmp = self.path.with_suffix(".tmp")  # a run killed while writing keeps the previous state
        torch.save(state, tmp)
        tmp.replace(self.path)


def load_state(folder: str | Path, what: str) -> dict[str, Any]:
    """The state written by a `draftline train` run in ``folder``, or a one-line error."""
    path = Path(folder) / STATE_FILE
    if not path.is_file():
        raise ConfigError(f"--resume {folder}: no {STATE_FILE} there; give a folder written by `draftline train "
                          f"{what}` (a published checkpoint alone holds only weights: start from it with --init)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: name it rather than unpickle a traceback
        raise ConfigError(f"--resume {folder}: {STATE_FILE} is not readable ({type(exc).__name__}); "
                          "it is damaged: resume from another checkpoint or start again") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ConfigError(f"--resume {folder}: {STATE_FILE} is not a draftline training state of format {FORMAT}")
    return {**state, "folder": str(folder)}


def resumed_config(state: dict[str, Any], what: str, given: dict[str, Any], folder: str | Path) -> dict[str, Any]:
    """The resumed run's config: the saved run's knobs, with those given on the command line
    where a resume may change them; any other given knob must equal the saved one."""
    run = state["run"]
    if run["method"] != what:
        raise ConfigError(f"--resume {folder}: it holds a {run['method']} run, not {what}; "
                          f"resume it with `draftline train {run['method']} --resume {folder}`, "
                          f"or start a new {what} run without --resume")
    saved = run["config"]
    for knob, value in sorted(given.items()):
        if knob not in MAY_CHANGE and saved.get(knob) != value:
            flag = "--" + knob.replace("_", "-")
            raise ConfigError(f"--resume {folder}: {flag} {value} differs from the run's {saved.get(knob)}; "
                              f"drop {flag} to continue the run (only --steps, --max-seconds and --eval-every "
                              "may change), or start a new run with --init")
    return {**saved, **{k: v for k, v in given.items() if k in MAY_CHANGE}}


def check_target(state: dict[str, Any], target: TargetModel, folder: str | Path, target_path: str) -> None:
    """Refuse to resume a run over another target, naming the first field that differs."""
    saved, now = state["run"]["target"], target_identity(target)
    fix = f"resume with the run's target, or start a new run from its weights with --init {folder}"
    for key, value in now["config"].items():
        if saved["config"].get(key) != value:
            raise ConfigError(f"--target {target_path}: {key} is {value}, the resumed run's target had "
                              f"{saved['config'].get(key)}; {fix}")
    if abs(saved["embed_sum"] - now["embed_sum"]) > 1e-6 * max(1.0, abs(saved["embed_sum"])):
        raise ConfigError(f"--target {target_path}: same shape, other weights than the resumed run's target "
                          f"(embedding checksum {now['embed_sum']:.6g}, the run's {saved['embed_sum']:.6g}); {fix}")


def restore(state: dict[str, Any], model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator) -> Position:
    """Put the saved run's weights, optimizer, data order and RNG back; return where it stood."""
    folder = state["folder"]
    try:
        model.load_state_dict(state["weights"])
        opt.load_state_dict(state["optimizer"])
    except (RuntimeError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0]
        raise ConfigError(f"--resume {folder}: {STATE_FILE} does not fit the checkpoint beside it ({first}); "
                          "the folder was overwritten by another run: resume from that run's own folder") from None
    gen.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    return Position(state["step"], state["time_progress"])
