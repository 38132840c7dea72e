# Cluster environment for every zerotune sbatch script: edit the placeholders once, here.
# Sourced, not executed. Nothing here changes what a recipe means; it only wires the cluster.

# --- PLACEHOLDERS: your site's modules / conda (e.g. Taiwania 2) ------------------------------
# module purge
# module load compiler/gnu/10.2.0 cuda/12.6        # CUDA 12.6: the last torch builds with sm_70 (V100)
# source ~/miniconda3/etc/profile.d/conda.sh && conda activate zerotune   # if not using .venv
# -----------------------------------------------------------------------------------------------

export ZEROTUNE_PY="${ZEROTUNE_PY:-$PWD/.venv/bin/python}"
export HF_HOME="${HF_HOME:-$PWD/.cache/huggingface}"          # weights + datasets cache on shared storage
export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}"   # DeepSpeed JIT ops, built once
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}"   # Liger kernels
export TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"

# NCCL: NVLink inside a node, InfiniBand between nodes. Adjust the interface names for your site.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
export NCCL_ASYNC_ERROR_HANDLING=1            # a dead rank aborts the job instead of hanging it
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
# export NCCL_SOCKET_IFNAME=ib0               # PLACEHOLDER
# export NCCL_IB_HCA=mlx5_0                   # PLACEHOLDER
