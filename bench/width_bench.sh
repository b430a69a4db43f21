#!/usr/bin/env bash
# Each verify width's round on the 8B shape, simulated acceptance: DFlash (block 16) at 32 and
# 64 rows verifying 16, 8, 4 and 2 tokens (the widths the draft policy chooses among).
set -u
sed -e "s/max_batch_size: 32/max_batch_size: 64/" -e "s/max_model_len: 4096/max_model_len: 1024/" \
    specs/qwen3-8b-random-dflash.yaml > /tmp/dflash-64.yaml
python3 -m draftline bench --spec /tmp/dflash-64.yaml --batch-sizes ${1:-32,64} --prompt-len 128 --new-tokens 128 \
  --acceptance dflash-paper --verify-widths 16,8,4,2
