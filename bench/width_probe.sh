#!/usr/bin/env bash
# What a narrower verify buys at many rows: DFlash at block 16, 8 and 4 on the 8B shape,
# simulated acceptance (dflash-paper), 1024-token contexts so four engines fit.
set -u
for b in 16 8 4; do
  sed -e "s/block_size: 16/block_size: $b/" -e "s/max_batch_size: 32/max_batch_size: 64/" \
      -e "s/max_model_len: 4096/max_model_len: 1024/" specs/qwen3-8b-random-dflash.yaml > /tmp/dflash-b$b.yaml
done
python3 -m draftline bench --spec /tmp/dflash-b16.yaml --also /tmp/dflash-b8.yaml,/tmp/dflash-b4.yaml \
  --batch-sizes ${1:-16,32,64} --prompt-len 128 --new-tokens 128 --acceptance dflash-paper
