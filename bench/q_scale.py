"""Does a sharper or flatter q accept more? `draftline eval` with every drafter's logits divided
by S before the request's temperature makes q (the proposal the acceptance rule then reads, so
the run stays lossless). A probe: it rebinds the methods' probs_from_logits for this process.

    python bench/q_scale.py S eval SPEC... --dataset humaneval --temperatures 1.0 --draft-policy always
"""

import sys

import draftline.core.methods.dflash as dflash
import draftline.core.methods.eagle3 as eagle3
import draftline.core.methods.gemma4_mtp as gemma4_mtp
from draftline.cli import main
from draftline.core.sampling import probs_from_logits


def scaled(s: float):
    def probs(logits, batch, filters=None):
        return probs_from_logits(logits / s, batch, filters)
    return probs


if __name__ == "__main__":
    for module in (dflash, eagle3, gemma4_mtp):
        module.probs_from_logits = scaled(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
