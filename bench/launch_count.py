"""The kernels a round launches, counted on the CPU: the cuda backend under the Triton
interpreter (rounds run eagerly there, so every kernel a captured graph would hold is called
from Python), each Triton kernel by name and each PyTorch op that would be a launch of its own.

`python bench/launch_count.py [SPEC] [BATCH] [--sites] [--tokens=N]` (default the tiny DFlash pair
at 16 rows, 24 new tokens a request; several minutes: the interpreter runs every kernel). --sites
also names where each PyTorch op is called from (the three innermost frames of the project's own
files). On the tiny pair a round's GPU time is launch latency, so the count is the round's cost
there."""
import collections
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import triton.runtime.interpreter as interpreter  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from draftline.core.engine import Engine  # noqa: E402
from draftline.core.sampling import SamplingParams  # noqa: E402
from draftline.core.spec import load_spec  # noqa: E402
from draftline.core.training.corpus import read_prompts  # noqa: E402

NOT_LAUNCHES = {"empty", "empty_strided", "view", "_unsafe_view", "t", "transpose", "permute", "expand", "select",
                "slice", "unsqueeze", "squeeze", "reshape", "as_strided", "detach", "alias", "unflatten", "split",
                "split_with_sizes", "unbind", "_reshape_alias", "lift_fresh", "empty_like", "new_empty",
                "resolve_conj", "resolve_neg"}  # views, allocations, and flag checks that copy nothing here


class Counter(TorchDispatchMode):
    """PyTorch ops outside Triton kernels (the interpreter's own tensor work is not a launch)."""

    def __init__(self, counts: collections.Counter, inside: list[int], sites: collections.Counter | None = None):
        super().__init__()
        self.counts, self.inside, self.sites = counts, inside, sites

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside[0] and name not in NOT_LAUNCHES:
            self.counts["torch " + name] += 1
            if self.sites is not None:
                self.sites[(name, _site())] += 1
        return func(*args, **(kwargs or {}))


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project's checkout


def _site() -> str:
    """The three innermost frames in the project's files (core/, backends/), innermost first."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if f.filename.startswith(ROOT) and "/bench/" not in f.filename][-3:]
    return " <- ".join(f"{os.path.relpath(f.filename, ROOT)}:{f.lineno} {f.name}" for f in reversed(frames))


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = args[0] if args else "specs/tiny-dflash.yaml"
    batch = int(args[1]) if len(args) > 1 else 16
    tokens = next((int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--tokens=")), 24)
    sites = collections.Counter() if "--sites" in sys.argv else None
    data = load_spec(path).model_dump(mode="python")
    data["backend"], data["model"]["device"] = "cuda", "cpu"
    data["server"].update(max_batch_size=batch)
    engine = Engine(type(load_spec(path)).model_validate(data), draft_policy="always")
    backend, counts, inside, rounds = engine.machine.backend, collections.Counter(), [0], collections.Counter()
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        counts["triton " + self.fn.__name__] += 1
        inside[0] += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            inside[0] -= 1

    interpreter.InterpretedFunction.run = counted_run
    launch = backend.launch

    def counted_launch(reqs, width, then=None):
        rounds[len(reqs)] += 1
        with Counter(counts, inside, sites):
            return launch(reqs, width, then)

    backend.launch = counted_launch
    engine.generate(read_prompts("specs/tiny/eval_prompts.jsonl")[:batch], SamplingParams(max_new_tokens=tokens, ignore_eos=True))
    total = sum(rounds.values())
    print(f"{path}: {total} rounds (rows: {dict(sorted(rounds.items()))}), {sum(counts.values()) / total:.1f} launches a round")
    for name, n in counts.most_common(40):
        print(f"  {n / total:6.1f} a round  {name}")
    for (name, site), n in (sites or collections.Counter()).most_common(40):
        print(f"  {n / total:6.1f} a round  torch {name}: {site}")


if __name__ == "__main__":
    main()
