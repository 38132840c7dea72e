# Cluster environment for every zerotune sbatch script, sourced from the repository root.
# Nothing here changes what a recipe means; it only wires the cluster. Site-specific lines are
# commented out: uncomment or export them in your shell, never commit your site's values here.

# --- your site's modules / conda (e.g. Taiwania 2) ----------------------------------------------
# module purge
# module load compiler/gnu/10.2.0 cuda/12.6        # nvcc for check_t4.sbatch's llama.cpp CUDA build
# torch: CUDA 12.x wheels carry sm_70 (V100), CUDA 13 ones do not (pytorch#157517); `make setup TORCH=cu126`
# checks that the pinned torch has a wheel at that index and that its triton pin matches requirements.lock.
# source ~/miniconda3/etc/profile.d/conda.sh && conda activate zerotune   # if not using .venv
# -----------------------------------------------------------------------------------------------

export ZEROTUNE_PY="${ZEROTUNE_PY:-$PWD/.venv/bin/python}"
if [[ -z "${HF_HOME:-}" ]]; then
  export HF_HOME="$PWD/.cache/huggingface"                    # weights + datasets cache on shared storage
  # ...but the token where `hf auth login` (run without HF_HOME) put it, not under the moved HF_HOME
  export HF_TOKEN_PATH="${HF_TOKEN_PATH:-$HOME/.cache/huggingface/token}"
fi
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"   # DeepSpeed JIT ops, built once
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}"   # Liger kernels
export TOKENIZERS_PARALLELISM=false

# NCCL: NVLink inside a node, InfiniBand between nodes.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_ASYNC_ERROR_HANDLING=1            # a dead rank aborts the job instead of hanging it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# export NCCL_SOCKET_IFNAME=ib0               # your site's interface names
# export NCCL_IB_HCA=mlx5_0

# The allocation's CPUs: SLURM sets SLURM_CPUS_PER_TASK only when -c was given.
# shellcheck disable=SC2034  # read by the sbatch scripts that source this file
ZEROTUNE_CPUS="${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-1}}"
# srun does not pass the job's --cpus-per-task on to a step (SLURM 22.05-23.02): without this a step may get 1 CPU.
export SRUN_CPUS_PER_TASK="$ZEROTUNE_CPUS"
