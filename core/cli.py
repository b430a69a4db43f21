"""The `draftline` commands (their flags are in ``draftline.core.arguments``); the server's two,
serve and bench-serve, are ``draftline.api.commands`` (core never imports the API)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import traceback
from pathlib import Path
from typing import Any

from . import train_inputs
from .arguments import TRAIN_KNOBS
from .failures import failure_line
from .models.checkpoint import CheckpointError
from .models.config import ConfigError


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
    quant = "unquantized (the checkpoint's dtype)" if target.fp8 is None else (
        f"fp8 e4m3 decoder projections, {target.fp8.block[0]} x {target.fp8.block[1]} weight blocks, "
        f"activations per token in groups of {target.fp8.block[1]} (dynamic); norms, embeddings, LM head bf16")
    print(f"weights: {quant}")
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
    from . import parallel
    from .engine import Engine
    from .spec import load_spec

    spec = load_spec(args.spec)
    size = spec.model.tensor_parallel_size
    if size > 1 and not parallel.in_rank():  # one process per rank, each running this command
        if args.seed is None:
            args.seed = spec.sampling.seed or random.getrandbits(62)  # one seed for every rank
        return parallel.launch(size, cmd_generate, args)
    engine = Engine.from_spec(spec, draft_policy="always")  # show the method itself, every round
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
    if parallel.rank() != 0:
        return 0
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
        speedup = "n/a (no tokens generated)" if result["speedup"] is None else f"{result['speedup']}x"
        print(f"none baseline: {b['meta_info']['tokens_per_s']} tok/s; speedup {speedup}; output {same}")
    for r in result.get("rounds", []):
        print(f"  @{r['position']}: drafted {r['drafted']} accepted {r['accepted']} emitted {r['emitted']}")


def cmd_corpus(args: argparse.Namespace) -> int:
    """Your own text (--data), or this interpreter's standard library; tokenized by --tokenizer
    (a target's folder) or by a BPE trained on the text."""
    folder = Path(args.tokenizer) if args.tokenizer else None
    if folder is not None and not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"--tokenizer {folder}: no tokenizer.json there; give the target's HF-format folder")
    if folder is not None:  # a damaged one is named before the text is read
        from .models.tokenizer import load_tokenizer

        load_tokenizer(folder)
    if args.data:
        from .training.documents import build_user_corpus

        info = build_user_corpus(Path(args.out), args.data, folder, args.vocab_size, args.prompts)
    else:
        from .training.corpus import build_corpus

        info = build_corpus(Path(args.out), args.vocab_size, args.prompts, folder)
    print(json.dumps(info, indent=2))
    print(f"wrote {args.out}/corpus.pt ({info['bytes'] / 2**20:.1f} MiB: {info['train_tokens']:,} train and "
          f"{info['heldout_tokens']:,} held-out tokens), tokenizer.json, tokenizer_config.json, eval_prompts.jsonl")
    return 0


def _train_config(kind: type, args: argparse.Namespace, preset: str, resume: dict | None = None):
    """The run's config from its dataclass defaults (a resumed run's own, with ``resume``) and
    the knobs given on the command line."""
    import dataclasses

    from .training.state import resumed_config

    given = {k: v for k, v in vars(args).items() if k in TRAIN_KNOBS and v is not None}
    fields = {f.name for f in dataclasses.fields(kind)}
    stray = sorted(set(given) - fields)
    if stray:
        flags = ", ".join("--" + k.replace("_", "-") for k in stray)
        raise ConfigError(f"train {args.what}: {flags} does not apply to this command; drop it")
    cfg = kind(**resumed_config(resume, args.what, given, args.resume)) if resume is not None else \
        kind(**{"preset": preset, **given})
    train_inputs.preset(args.what, cfg.preset)
    return cfg


def cmd_train(args: argparse.Namespace) -> int:
    import shutil

    from .models.tokenizer_files import copy_tokenizer_files

    if not (args.out or args.resume):
        raise ConfigError(f"train {args.what} needs --out FOLDER: where to write the checkpoint")
    out = Path(args.out or args.resume)
    train_inputs.out_folder(out)
    device = train_inputs.device(args.device)
    if args.what == "target":
        from .training.pretrain import PretrainConfig, pretrain

        if args.resume or args.init:
            raise ConfigError("--resume and --init apply to drafters (train dflash|eagle3|gemma4_mtp); "
                              "train target starts afresh: drop the flag")
        cfg = _train_config(PretrainConfig, args, "tiny-code")
        data = train_inputs.corpus(args.data, cfg.seq_len)
        out.mkdir(parents=True, exist_ok=True)  # the tokenizer first: every checkpoint written is whole
        shutil.copy(Path(args.data) / "tokenizer.json", out / "tokenizer.json")
        # its tokenizer_config.json and chat template (a corpus written before it had them: generated)
        copy_tokenizer_files(Path(args.data), out, _token_name(out, data["eos_id"]))
        summary = pretrain(data["train"], data["heldout"], data["vocab_size"], data["eos_id"], out, cfg, device)
    else:
        summary = _train_drafter(args, out, device)
    print(summary.report())
    return 0


def _drafter_run(what: str) -> tuple[type, Any, str]:
    """A drafter's run config, training function and default preset."""
    if what == "eagle3":
        from .training.eagle3 import Eagle3TrainConfig, train_eagle3

        return Eagle3TrainConfig, train_eagle3, "tiny-code-eagle3"
    if what == "gemma4_mtp":
        from .training.mtp import MTPTrainConfig, train_mtp

        return MTPTrainConfig, train_mtp, "tiny-code-mtp"
    from .training.distill import DistillConfig, train_dflash

    return DistillConfig, train_dflash, "tiny-code-dflash"


def _train_drafter(args: argparse.Namespace, out: Path, device):
    """Every argument checked before any work: the resumed state (its method, knobs and
    target), then --target; a resumed run needs no corpus (its distilled text is in its state)."""
    from .models.loader import load_target
    from .training.state import check_target, load_state

    kind, train, preset = _drafter_run(args.what)
    if args.resume and args.init:
        raise ConfigError("--resume and --init: give one (--resume continues a run where it stopped, "
                          "--init starts a new run from a checkpoint's weights)")
    resume = load_state(args.resume, args.what) if args.resume else None
    cfg = _train_config(kind, args, preset, resume)
    if resume is not None and resume["step"] >= cfg.steps:
        raise ConfigError(f"--resume {args.resume}: the run is at step {resume['step']} of --steps {cfg.steps}, "
                          "nothing is left; give a larger --steps to train on")
    _check_target(args)
    data = None if resume else train_inputs.corpus(args.data)
    if resume is None:
        train_inputs.same_tokenizer(args.data, args.target)
    target = load_target(args.target)
    if resume is not None:
        check_target(resume, target, args.resume, args.target)
    init = Path(args.resume or args.init) if (args.resume or args.init) else None
    return train(target, data, out, cfg, device, init, resume)


def _token_name(folder: Path, token_id: int) -> str:
    from .models.tokenizer import load_tokenizer

    return load_tokenizer(folder).id_to_token(int(token_id))


def _check_target(args: argparse.Namespace) -> None:
    from .models.checkpoint import tensor_files
    from .models.config import read_model_config

    if not args.target:
        raise ConfigError(f"train {args.what} needs --target FOLDER: the target's checkpoint folder "
                          "(written by `draftline train target`, or an HF-format folder)")
    folder = Path(args.target)
    if not (folder / "config.json").is_file():
        raise ConfigError(f"--target {folder}: no config.json there; give the target's checkpoint folder "
                          "(written by `draftline train target`, or an HF-format folder)")
    try:
        read_model_config(folder), tensor_files(folder)
    except (ConfigError, CheckpointError) as exc:
        raise ConfigError(f"--target {folder}: {exc}") from None
    if args.init and not (Path(args.init) / "config.json").is_file():
        raise ConfigError(f"--init {args.init}: no config.json there; give a drafter checkpoint folder "
                          f"written by `draftline train {args.what}`")


def cmd_bench(args: argparse.Namespace) -> int:
    import torch

    from . import benchmark
    from .engine import Engine
    from .spec import load_spec

    if args.verify_widths and not args.acceptance:
        raise ConfigError("--verify-widths times drafting rounds whose drafts are accepted: give --acceptance PROFILE too")
    if not torch.cuda.is_available():
        raise ConfigError("draftline bench measures GPU time against the bandwidth floor; it needs a CUDA device")
    spec = load_spec(args.spec)
    # each static batch prefilled in one step, its rows together; no prefix store (random prompts
    # never meet it, and each engine of the run would hold one beside its KV cache)
    budget = max(spec.server.max_num_batched_tokens, max(args.batch_sizes) * args.prompt_len)
    server = {"max_num_batched_tokens": budget, "enable_prefix_caching": False}
    spec = spec.model_copy(update={"server": spec.server.model_copy(update=server)})
    engine = Engine.from_spec(spec, draft_policy="always")
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
        for ctx, us, tbs, sdpa in engine.backend.attention_bandwidth([512, 4096, 32768, 131072], 1, 16):
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
    rows = benchmark.bench_acceptance(engine, specs, batches, args.prompt_len, args.new_tokens, rate,
                                      args.verify_widths)
    import torch

    print(f"{args.spec}: prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, {torch.cuda.get_device_name()}")
    print(benchmark.format_sim(rows, args.acceptance))
    return 0


def _same_target(spec, base, path: str):
    if spec.model != base.model:
        raise ConfigError(f"--also {path}: its model section differs from --spec's; --also benches other "
                          "methods over the same target, so give specs with the same model")
    return spec


def _schema_file(path: str):
    """The constraint of ``eval --json-schema``: a JSON schema file."""
    from .grammar import Constraint

    try:
        return Constraint("json_schema", json.dumps(json.loads(Path(path).read_text())))
    except OSError as exc:
        raise ConfigError(f"--json-schema {path}: cannot read it ({exc.strerror}); give a JSON schema file") from None
    except ValueError as exc:
        raise ConfigError(f"--json-schema {path}: not JSON ({exc}); give a JSON schema file") from None


def cmd_eval(args: argparse.Namespace) -> int:
    from .datasets import Dataset, load_dataset
    from .engine import Engine
    from .evaluation import evaluate, format_table, lossy, paper_table, plot
    from .prompt_file import read_prompt_file

    if args.plot:  # before the eval runs, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib, which is not installed: pip install matplotlib "
                              "(or the `plot` extra), or drop --plot") from None
    sets = ([load_dataset(d, args.field) for d in args.dataset] if args.dataset else
            [Dataset(Path(args.prompts).stem, tuple(read_prompt_file(args.prompts)), args.prompts)])
    sets = [Dataset(d.name, d.prompts[: args.num_prompts], d.source) for d in sets]
    constraints = [None] + ([] if args.json_schema is None else [_schema_file(args.json_schema)])
    results = []
    for path in args.spec:  # every method over the same prompts, each against its own interleaved `none`
        engine = Engine.from_spec(path, draft_policy=args.draft_policy)
        for data in sets:  # each run with a fresh draft policy: one run's measurements never steer another's
            results += [evaluate(engine.with_method(engine.spec.speculative), data, t, args.max_new_tokens, args.seed,
                                 c) for c in constraints for t in args.temperatures]
            if not args.json:
                print(f"{path}: {len(data.prompts)} prompts of {data.name} ({data.source}), {args.max_new_tokens} "
                      f"new tokens, batch 1, {engine.backend_name} backend on {engine.device}, draft policy "
                      f"{engine.policy.limit}")
    if args.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "round_lengths"} for r in results]))
    else:
        print(format_table(results) + "\n\n" + paper_table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 1 if lossy(results) else 0


COMMANDS = {"validate": cmd_validate, "explain": cmd_explain, "generate": cmd_generate, "eval": cmd_eval,
            "bench": cmd_bench, "corpus": cmd_corpus, "train": cmd_train}


def build_parser(serving=None):
    """The `draftline` parser; ``serving`` adds the server's commands (draftline.cli passes them)."""
    from . import arguments

    return arguments.build_parser(COMMANDS, serving)


def _logs_to_stderr() -> None:
    """Log lines go to stderr, so stdout carries only a command's result (a table, --json)."""
    import structlog

    structlog.configure(logger_factory=lambda *args: structlog.PrintLogger(sys.stderr))


def main(argv: list[str] | None = None, serving=None) -> int:
    """Run one command. A failure is one line on stderr naming what is wrong and the fix, and
    exit code 1; ``--debug`` adds the traceback."""
    args = build_parser(serving).parse_args(argv)
    _logs_to_stderr()
    try:
        return args.func(args)
    except Exception as exc:  # noqa: BLE001 (every failure is one line; --debug shows where it came from)
        if getattr(args, "debug", False):
            traceback.print_exc()
        print(f"error: {failure_line(exc)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
