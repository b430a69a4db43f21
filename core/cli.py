"""The `draftline` command: validate, explain, generate."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from . import flags
from .flags import NEW_TOKENS, NON_NEGATIVE, PORT, POSITIVE, SEED, TEMPERATURE
from .models.config import ConfigError
from .models.checkpoint import CheckpointError

PROJECT_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SPEC = PROJECT_ROOT / "specs" / "tiny-dflash.yaml"


def _spec_files(paths: list[str]) -> list[Path]:
    out = []
    for p in map(Path, paths):
        out += sorted(p.rglob("*.y*ml")) if p.is_dir() else [p]
    return out


def cmd_validate(args: argparse.Namespace) -> int:
    from .spec import SpecError, check_files, device_problems, load_spec

    files, failed = _spec_files(args.paths), 0
    if not files:
        print(f"no spec files (*.yaml, *.yml) found under {' '.join(args.paths)}", file=sys.stderr)
        return 1
    for path in files:
        notes = []
        try:
            spec = load_spec(path)
            problems = check_files(spec) if args.check_files else []
            notes = [] if args.check_files else device_problems(spec)
        except SpecError as exc:
            problems = exc.messages
        if problems:
            failed += 1
            print(f"FAIL {path}")
            for msg in problems:
                print(f"  - {msg}")
        else:
            print(f"ok   {path}")
        for msg in notes:  # a valid spec this machine cannot run; --check-files counts it as a failure
            print(f"  note: {msg}")
    print(f"{len(files) - failed} valid, {failed} invalid")
    return 1 if failed else 0


def cmd_explain(args: argparse.Namespace) -> int:
    from .machine import describe_transitions
    from .registry import METHODS
    from .spec import load_spec

    spec = load_spec(args.spec)
    target = spec.model.config(read_files=True)
    plan = METHODS.get(spec.speculative.method)(spec.speculative).plan(target)
    print(f"spec:    {args.spec}")
    print(f"target:  {target.arch}, {target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size}")
    print(f"backend: {spec.backend}\n\nplan")
    print("\n".join("  " + line for line in plan.describe()))
    print("\nphases (per request)")
    print("\n".join("  " + line for line in describe_transitions()))
    print("\nround: DRAFT proposes K tokens -> VERIFY runs the target on [last token, drafts]")
    print("       -> ACCEPT keeps the longest accepted prefix plus one corrected/bonus token")
    return 0


def _sampling(engine: Any, args: argparse.Namespace):
    return engine.spec.sampling.params(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed
    )


def _run(engine: Any, prompt: str, params: Any, trace: bool) -> dict[str, Any]:
    return engine.generate([prompt], params, trace=trace)[0].to_dict(trace=trace)


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine import Engine

    engine = Engine.from_spec(args.spec, draft_policy="always")  # show the method itself, every round
    params = _sampling(engine, args)
    baseline = engine.with_method({"method": "none"}) if args.compare else None
    if baseline is not None:  # warm both up so one-time costs stay out of the comparison
        warm = engine.spec.sampling.params(max_new_tokens=4)
        engine.generate([args.prompt], warm), baseline.generate([args.prompt], warm)
    result = _run(engine, args.prompt, params, args.trace)
    if baseline is not None:
        result["baseline"] = _run(baseline, args.prompt, params, False)
        base_tps = result["baseline"]["meta_info"]["tokens_per_s"]
        result["speedup"] = round(result["meta_info"]["tokens_per_s"] / base_tps, 3) if base_tps else None
    if args.json:
        print(json.dumps(result))
    else:
        _print_text(engine, args.prompt, result)
    return 0


def _print_text(engine: Any, prompt: str, result: dict[str, Any]) -> None:
    m = result["meta_info"]
    print(prompt + result["text"])
    print("-" * 60)
    print(
        f"{engine.plan.method} ({engine.backend_name}, {engine.device}, {str(engine.dtype).removeprefix('torch.')}): "
        f"{m['completion_tokens']} tokens, {m['tokens_per_s']} tok/s, tau {m['spec_accept_length']}, "
        f"accept rate {m['spec_accept_rate']:.1%}, {m['spec_verify_ct']} rounds, finish {m['finish_reason']}"
    )
    if "baseline" in result:
        b = result["baseline"]
        same = "identical" if b["output_ids"] == result["output_ids"] else "different (sampled)"
        print(f"none baseline: {b['meta_info']['tokens_per_s']} tok/s; speedup {result['speedup']}x; output {same}")
    for r in result.get("rounds", []):
        print(f"  @{r['position']}: drafted {r['drafted']} accepted {r['accepted']} emitted {r['emitted']}")


def cmd_corpus(args: argparse.Namespace) -> int:
    from .training.corpus import build_corpus

    info = build_corpus(Path(args.out), args.vocab_size, args.prompts)
    print(json.dumps(info, indent=2))
    print(f"wrote {args.out}/corpus.pt ({info['bytes'] / 2**20:.1f} MiB: {info['train_tokens']:,} train and "
          f"{info['heldout_tokens']:,} held-out tokens), tokenizer.json, eval_prompts.jsonl")
    return 0


def _corpus(path: str):
    import torch

    file = Path(path) / "corpus.pt"
    if not file.is_file():
        raise FileNotFoundError(f"{file}: not found; build it first with `draftline corpus --out {path}`")
    return torch.load(file)


def _train_config(kind: type, args: argparse.Namespace, preset: str):
    """The run's config from its dataclass defaults and the knobs given on the command line."""
    import dataclasses

    given = {k: v for k, v in vars(args).items() if k in TRAIN_KNOBS and v is not None}
    fields = {f.name for f in dataclasses.fields(kind)}
    stray = sorted(set(given) - fields)
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        raise ConfigError(f"train {args.what}: {flags} does not apply to this command; drop it")
    return kind(**{"preset": preset, **given})


def cmd_train(args: argparse.Namespace) -> int:
    import shutil

    from .training.loop import pick_device

    if args.what != "target":  # its arguments before any work
        _check_target(args)
    data, device, out = _corpus(args.data), pick_device(args.device), Path(args.out)
    if args.what == "target":
        from .training.pretrain import PretrainConfig, pretrain

        cfg = _train_config(PretrainConfig, args, "tiny-code")
        out.mkdir(parents=True, exist_ok=True)  # the tokenizer first: every checkpoint written is whole
        shutil.copy(Path(args.data) / "tokenizer.json", out / "tokenizer.json")
        summary = pretrain(data["train"], data["heldout"], data["vocab_size"], data["eos_id"], out, cfg, device)
    else:
        from .models.loader import load_target

        init = Path(args.init) if args.init else None
        if args.what == "eagle3":
            from .training.eagle3 import Eagle3TrainConfig, train_eagle3

            cfg = _train_config(Eagle3TrainConfig, args, "tiny-code-eagle3")
            summary = train_eagle3(load_target(args.target), data, out, cfg, device, init)
        elif args.what == "gemma4_mtp":
            from .training.mtp import MTPTrainConfig, train_mtp

            cfg = _train_config(MTPTrainConfig, args, "tiny-code-mtp")
            summary = train_mtp(load_target(args.target), data, out, cfg, device, init)
        else:
            from .training.distill import DistillConfig, train_dflash

            cfg = _train_config(DistillConfig, args, "tiny-code-dflash")
            summary = train_dflash(load_target(args.target), data, out, cfg, device, init)
    print(summary.report())
    return 0


def _check_target(args: argparse.Namespace) -> None:
    from .models.checkpoint import tensor_files
    from .models.config import model_config, read_config_json

    if not args.target:
        raise ConfigError(f"train {args.what} needs --target FOLDER: the target's checkpoint folder "
                          "(written by `draftline train target`, or an HF-format folder)")
    folder = Path(args.target)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--target {folder}: no config.json there; give the target's checkpoint folder "
                          "(written by `draftline train target`, or an HF-format folder)")
    try:
        model_config(read_config_json(folder)), tensor_files(folder)
    except (ConfigError, CheckpointError) as exc:
        raise ConfigError(f"--target {folder}: {exc}") from None
    if args.init and not (Path(args.init) / "config.json").is_file():
        raise ConfigError(f"--init {args.init}: no config.json there; give a drafter checkpoint folder "
                          f"written by `draftline train {args.what}`")


# name -> (value type, help); each run's default comes from its config dataclass
TRAIN_KNOBS = {
    "preset": (str, "model shape preset of what is trained"),
    "steps": (POSITIVE, "optimizer steps"),
    "batch_size": (POSITIVE, "training rows per step"),
    "seq_len": (POSITIVE, "tokens per training row"),
    "lr": (flags.real(0.0, strict=True), "peak learning rate (cosine schedule after warm-up)"),
    "seed": (SEED, "seed of data order, generation and init"),
    "num_sequences": (POSITIVE, "sequences the target generates to distil from"),
    "gen_len": (POSITIVE, "tokens generated per distillation sequence"),
    "gen_batch": (POSITIVE, "sequences generated per target batch"),
    "anchors": (POSITIVE, "block anchors per training row"),
    "eval_every": (POSITIVE, "steps between held-out evaluations"),
    "max_seconds": (flags.real(0.0, strict=True), "the whole run's wall-time budget (generation takes up to 40%%): "
                    "then evaluate and save; a checkpoint is also written at every evaluation"),
    "mix": (str, "prompt kind of each generation batch, cycled (bare, fn, sampled, warm)"),
    "warm_tokens": (NON_NEGATIVE, "`warm` rows: sampled tokens after a bare prompt before the greedy part"),
    "weight_decay": (flags.real(0.0), "AdamW weight decay"),
    "ttt_steps": (POSITIVE, "EAGLE-3: chained steps unrolled per training position"),
    "crop": (POSITIVE, "EAGLE-3 / MTP: tokens per training row, a window of a distilled sequence"),
    "chain_steps": (POSITIVE, "MTP: chained steps trained per context end"),
}


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from . import benchmark
    from .engine import Engine
    from .spec import load_spec

    if not torch.cuda.is_available():
        raise ConfigError("draftline bench measures GPU time against the bandwidth floor; it needs a CUDA device")
    engine = Engine.from_spec(args.spec, draft_policy="always")
    if engine.backend_name != "cuda":
        raise ConfigError(f"{args.spec}: backend is {engine.backend_name}; bench the cuda backend (backend: cuda or auto)")
    batches = args.batch_sizes
    too_big = [b for b in batches if b > engine.spec.server.max_batch_size]
    if too_big:
        raise ConfigError(f"--batch-sizes {too_big} exceed server.max_batch_size {engine.spec.server.max_batch_size}")
    if args.acceptance:
        return _bench_acceptance(args, engine, batches)
    bandwidth = benchmark.copy_bandwidth(engine.device)
    methods = [] if engine.plan.method == "none" or args.no_baseline else [{"method": "none"}]
    methods += [None] + [_same_target(load_spec(path), engine.spec, path).speculative
                         for path in filter(None, args.also.split(","))]
    rows = []
    for method in methods:  # each over the same target weights, one engine at a time
        run = engine if method is None else engine.with_method(method)
        rows += benchmark.bench_method(run, batches, args.prompt_len, args.new_tokens, bandwidth)
        del run
        torch.cuda.empty_cache()
    print(f"{args.spec}: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {torch.cuda.get_device_name()}")
    print(benchmark.format_rows(rows, bandwidth))
    if args.attention:
        print("verify attention alone (batch 1, 16 queries):  context  kernel µs  KV-read TB/s  torch SDPA µs")
        for ctx, us, tbs, sdpa in benchmark.attention_bandwidth(engine, [512, 4096, 32768, 131072], 1, 16):
            print(f"  {ctx:>8} {us:>10.1f} {tbs:>13.2f} {sdpa:>14.1f}")
    if args.peer == "hf":
        ms = benchmark.hf_peer(engine, args.prompt_len, args.new_tokens)
        ours = next(r.ms_token for r in rows if r.method == "none" and r.batch == 1) if 1 in batches else float("nan")
        print(f"transformers static cache + torch.compile, batch 1: {ms:.3f} ms/token; draftline none: {ours:.3f} "
              f"ms/token ({ms / ours:.2f}x faster)")
    return 0


def _bench_acceptance(args: argparse.Namespace, engine, batches: list[int]) -> int:
    from . import benchmark
    from .simulated import profile_rate
    from .spec import load_spec

    try:
        rate = profile_rate(args.acceptance)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    specs = [engine.spec.speculative] + [_same_target(load_spec(path), engine.spec, path).speculative
                                         for path in filter(None, args.also.split(","))]
    specs = [s for s in specs if s.method != "none"]
    if rate is None or not specs:
        raise ConfigError("--acceptance needs a drafting method (--spec or --also) and a profile other than "
                          "'random' (plain `draftline bench` measures the drafter's own drafts)")
    rows = benchmark.bench_acceptance(engine, specs, batches, args.prompt_len, args.new_tokens, rate)
    import torch

    print(f"{args.spec}: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {torch.cuda.get_device_name()}")
    print(benchmark.format_sim(rows, args.acceptance))
    return 0


def _same_target(spec, base, path: str):
    if spec.model != base.model:
        raise ConfigError(f"--also {path}: its model section differs from --spec's; --also benches other "
                          "methods over the same target, so give specs with the same model")
    return spec


def cmd_eval(args: argparse.Namespace) -> int:
    from .engine import Engine
    from .evaluation import evaluate, format_table, plot
    from .training.corpus import read_prompts

    if args.plot:  # before the eval runs, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                              "(or the `plot` extra), or drop --plot") from None
    prompts = read_prompts(args.prompts)[: args.num_prompts]
    temps = args.temperatures
    results, lossy = [], []
    for path in args.spec:  # every method over the same prompts, each against its own interleaved `none`
        engine = Engine.from_spec(path, draft_policy="always")
        ran = [evaluate(engine, prompts, t, args.max_new_tokens, args.seed) for t in temps]
        results += ran
        lossy += [r for r in ran if r["temperature"] == 0 and not r["lossless_check"].startswith(f"{len(prompts)}/")]
        if not args.json:
            print(f"{path}: {len(prompts)} prompts from {args.prompts}, {args.max_new_tokens} new tokens, batch 1, "
                  f"{engine.backend_name} backend on {engine.device}")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "round_lengths"} for r in results]))
    else:
        print(format_table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 1 if lossy else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from api.server import serve

    from .spec import load_spec

    spec = load_spec(args.spec)
    serve(spec, args.host or spec.server.host, args.port or spec.server.port)
    return 0


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from api.bench import run_bench

    from .spec import load_spec

    spec, levels = load_spec(args.spec), args.concurrency
    with _quiet(not args.verbose):  # the table, not every request's log line
        table = run_bench(spec, levels, args.requests, args.max_new_tokens, args.json)
    print(table)
    return 0


@contextlib.contextmanager
def _quiet(on: bool):
    """Info log lines off while the block runs (warnings still show); the old config after."""
    import logging

    import structlog

    old = structlog.get_config()
    if on:
        structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    try:
        yield
    finally:
        structlog.configure(**old)


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


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="draftline", description="Speculative-decoding inference engine.")
    sub = p.add_subparsers(dest="command", required=True)
    _spec_commands(sub)
    _generation_commands(sub)
    _serving_commands(sub)
    _training_commands(sub)
    return p


def _spec_commands(sub) -> None:
    v = sub.add_parser("validate", help="validate spec files and folders of specs")
    v.add_argument("paths", nargs="+", help="spec files, or folders searched for *.yaml / *.yml")
    v.add_argument("--check-files", action="store_true",
                   help="also open the checkpoints' config.json and safetensors headers, and check the device")
    v.set_defaults(func=cmd_validate)
    e = sub.add_parser("explain", help="print the compiled state machine of a spec")
    e.add_argument("spec", help="the spec file")
    e.set_defaults(func=cmd_explain)


def _generation_commands(sub) -> None:
    g = sub.add_parser("generate", help="generate a completion and print its statistics")
    g.add_argument("prompt", help="the prompt text")
    g.add_argument("--spec", default=str(DEFAULT_SPEC), help="the spec file")
    g.add_argument("--max-new-tokens", type=NEW_TOKENS, help="tokens to generate (default: the spec's sampling.max_new_tokens)")
    g.add_argument("--temperature", type=TEMPERATURE, help="0: greedy (default: the spec's sampling.temperature)")
    g.add_argument("--seed", type=SEED, help="sampling seed (default: the spec's, else a fresh one)")
    g.add_argument("--compare", action="store_true", help="also run method `none` and report the speedup")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--trace", action="store_true", help="add every round's drafts and acceptance")
    g.set_defaults(func=cmd_generate)
    ev = sub.add_parser("eval", help="tau, acceptance and speedup against `none` on held-out prompts")
    ev.add_argument("spec", nargs="*", default=[str(DEFAULT_SPEC)],
                    help="one or more specs, run over the same prompts (default: specs/tiny-dflash.yaml)")
    ev.add_argument("--prompts", default=str(PROJECT_ROOT / "specs" / "tiny" / "eval_prompts.jsonl"),
                    help="JSONL of prompts, one {\"prompt\": ...} per line")
    ev.add_argument("--num-prompts", type=POSITIVE, default=120, help="first N prompts of the file")
    ev.add_argument("--max-new-tokens", type=POSITIVE, default=128, help="tokens generated per prompt")
    ev.add_argument("--temperatures", type=flags.listed(TEMPERATURE), default="0,1.0",
                    help="comma-separated temperatures, each a separate run")
    ev.add_argument("--seed", type=SEED, default=0, help="seed of the sampled runs")
    ev.add_argument("--plot", help="write a PNG of per-position acceptance and the tau distribution (needs matplotlib)")
    ev.add_argument("--json", action="store_true", help="print one JSON list of the runs")
    ev.set_defaults(func=cmd_eval)
    _bench_command(sub)


def _bench_command(sub) -> None:
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
    bn.set_defaults(func=cmd_bench)


def _serving_commands(sub) -> None:
    sv = sub.add_parser("serve", help="start the HTTP server (/generate, /v1/completions, /v1/chat/completions, /metrics, ...)")
    sv.add_argument("--spec", default=str(DEFAULT_SPEC), help="the spec file")
    sv.add_argument("--host", help="address to bind (default: the spec's server.host, 127.0.0.1)")
    sv.add_argument("--port", type=PORT, help="port to bind (default: the spec's server.port, 8000)")
    sv.set_defaults(func=cmd_serve)
    bs = sub.add_parser("bench-serve", help="requests/s, tokens/s, TTFT, TPOT at several concurrencies, drafting on and off")
    bs.add_argument("--spec", default=str(DEFAULT_SPEC), help="the spec file")
    bs.add_argument("--concurrency", type=flags.listed(POSITIVE), default="1,4,16", help="comma-separated concurrency levels")
    bs.add_argument("--requests", type=NON_NEGATIVE, default=0, help="requests per level (0: max(8, 2 x concurrency))")
    bs.add_argument("--max-new-tokens", type=POSITIVE, default=64, help="tokens generated per request")
    bs.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    bs.add_argument("--verbose", action="store_true", help="also log every request")
    bs.set_defaults(func=cmd_bench_serve)


def _training_commands(sub) -> None:
    c = sub.add_parser("corpus", help="tokenize the standard library's Python source (train/held-out by module)")
    c.add_argument("--out", default="data/corpus", help="folder to write corpus.pt, tokenizer.json, eval_prompts.jsonl")
    c.add_argument("--vocab-size", type=flags.integer(260), default=4096, help="BPE vocabulary size")
    c.add_argument("--prompts", type=NON_NEGATIVE, default=120, help="held-out evaluation prompts to write")
    c.set_defaults(func=cmd_corpus)
    t = sub.add_parser("train", help="train the tiny target, or a drafter for it (DFlash, EAGLE-3, frozen-KV MTP)",
                       epilog=_knob_defaults())
    t.add_argument("what", choices=["target", "dflash", "eagle3", "gemma4_mtp"], help="what to train")
    t.add_argument("--data", default="data/corpus", help="folder written by `draftline corpus`")
    t.add_argument("--out", required=True, help="checkpoint folder to write")
    t.add_argument("--target", help="(drafters, required) the target's checkpoint folder")
    t.add_argument("--init", help="(drafters) continue training from this drafter checkpoint")
    t.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    for knob, (kind, text) in TRAIN_KNOBS.items():
        t.add_argument("--" + knob.replace("_", "-"), dest=knob, type=kind, help=text)
    t.set_defaults(func=cmd_train)


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


def main(argv: list[str] | None = None) -> int:
    from .engine import RequestError
    from .spec import SpecError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (SpecError, ConfigError, CheckpointError, RequestError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
