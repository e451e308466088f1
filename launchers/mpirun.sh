#!/bin/bash
# One `mpt launch` per host, started by OpenMPI's mpirun (its ssh/PMIx machinery); each takes
# its node rank from OMPI_COMM_WORLD_RANK and starts the GPU workers itself.
#   launchers/mpirun.sh node1,node2 examples/digits.py --epochs 30
set -euo pipefail

if (($# < 2)); then echo "usage: $0 HOST1,HOST2,... SCRIPT [SCRIPT_ARGS...]" >&2; exit 2; fi
IFS=, read -r -a HOSTS <<< "$1"
shift
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
BACKEND=${BACKEND:-ddp}
PRECISION=${PRECISION:-bf16-mixed}
MASTER_PORT=${MASTER_PORT:-29500}

# One rank per host (ppr:1:node); -x passes PATH so that the remote shells find `mpt`.
# Single quotes: OMPI_COMM_WORLD_* must be expanded on each host, not here.
exec mpirun -np "${#HOSTS[@]}" -H "$(IFS=,; echo "${HOSTS[*]}")" --map-by ppr:1:node -x PATH \
  bash -c 'mpt launch --nodes "$OMPI_COMM_WORLD_SIZE" --gpus '"$GPUS_PER_NODE"' \
  --nr "$OMPI_COMM_WORLD_RANK" --master-addr '"${HOSTS[0]}"' --master-port '"$MASTER_PORT"' \
  --backend '"$BACKEND"' --precision '"$PRECISION"' "$@"' mpt "$@"
