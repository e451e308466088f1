#!/bin/bash
# One `mpt launch` per host, started by horovodrun (ssh, gloo rendezvous); each takes its node
# rank from HOROVOD_RANK (OMPI_COMM_WORLD_RANK under --mpi) and starts the GPU workers itself.
# For clusters where horovodrun is how jobs reach their hosts; with --backend horovod,
# `mpt launch --backend horovod --hosts node1,node2` runs horovodrun for you instead.
#   launchers/horovodrun.sh node1,node2 examples/digits.py --epochs 30
set -euo pipefail

if (($# < 2)); then echo "usage: $0 HOST1,HOST2,... SCRIPT [SCRIPT_ARGS...]" >&2; exit 2; fi
IFS=, read -r -a HOSTS <<< "$1"
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
BACKEND=${BACKEND:-ddp}
PRECISION=${PRECISION:-bf16-mixed}
MASTER_PORT=${MASTER_PORT:-29500}
SLOTS=$(printf '%s:1,' "${HOSTS[@]}")

exec horovodrun -np "${#HOSTS[@]}" -H "${SLOTS%,}" \
  bash -c 'mpt launch --nodes "${HOROVOD_SIZE:-$OMPI_COMM_WORLD_SIZE}" \
  --gpus '"$GPUS_PER_NODE"' --nr "${HOROVOD_RANK:-$OMPI_COMM_WORLD_RANK}" \
  --master-addr '"${HOSTS[0]}"' --master-port '"$MASTER_PORT"' \
  --backend '"$BACKEND"' --precision '"$PRECISION"' "$@"' mpt "$@"
