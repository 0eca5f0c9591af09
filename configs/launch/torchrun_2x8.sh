#!/bin/bash
# MASTER_ADDR=node0.example NODE_RANK=0 bash configs/launch/torchrun_2x8.sh   # on the first machine
# MASTER_ADDR=node0.example NODE_RANK=1 bash configs/launch/torchrun_2x8.sh   # on the second
# GRPO on 2 nodes x 8 GPUs with torchrun: Lightning's TorchElasticEnvironment takes the ranks from torchrun.
# Extra arguments are passed to `lit-rl fit` (e.g. --trainer.max_steps 100).
set -euo pipefail
: "${MASTER_ADDR:?set MASTER_ADDR to the address of the first node}"
: "${NODE_RANK:?set NODE_RANK to 0 on the first node, 1 on the second}"
torchrun \
    --nnodes 2 \
    --nproc-per-node 8 \
    --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" \
    --master-port "${MASTER_PORT:-29500}" \
    -m lit_rl.cli fit \
    --config configs/grpo_8gpu.yaml \
    --trainer.num_nodes 2 \
    --trainer.devices 8 \
    "$@"
