#!/usr/bin/env bash
# One command that starts a training run and continues it after a failure: torchrun restarts every worker when one
# dies (--max-restarts), and train.py's ckpt_path=last resumes from the newest complete checkpoint of the run
# directory (a fresh start while there is none). Run the same script on every node; RUN_DIR must be on a filesystem
# every node shares, and the same for every attempt.
#
#   examples/cluster/torchrun_restarts.sh                                      # one machine, 4 processes
#   NNODES=2 NODE_RANK=0 HEAD=10.0.0.1 examples/cluster/torchrun_restarts.sh   # on node 0 ...
#   NNODES=2 NODE_RANK=1 HEAD=10.0.0.1 examples/cluster/torchrun_restarts.sh   # ... and on node 1
#
# Extra arguments go to train.py (e.g. trainer=gpu strategy.tensor_parallel_size=2).
set -euo pipefail
cd "$(dirname "$0")/../.."
NNODES=${NNODES:-1}
NPROC=${NPROC:-4}                 # processes per node: trainer.devices
NODE_RANK=${NODE_RANK:-0}
HEAD=${HEAD:-127.0.0.1}           # node 0's address: the rendezvous endpoint
PORT=${PORT:-29500}
RUN_DIR=${RUN_DIR:-outputs/gpt}   # shared by every node and every attempt
PYTHON=${PYTHON:-python}

exec "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" --node-rank="$NODE_RANK" \
    --max-restarts=3 --rdzv-backend=c10d --rdzv-endpoint="$HEAD:$PORT" --rdzv-id=gpt \
    train.py trainer.num_nodes="$NNODES" trainer.devices="$NPROC" \
    strategy=pipeline model=transformer data=synthetic_tokens trainer.max_steps=2000 \
    hydra.run.dir="$RUN_DIR" ckpt_path=last callbacks.step_checkpoint.every_n_train_steps=100 "$@"
