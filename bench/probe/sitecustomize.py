"""On PYTHONPATH only for bench/bench_train.py's `python -m zerotune finetune` runs: installs train_probe in the
torchrun workers (RANK set) when ZT_BENCH_PROBE names the output file. zerotune's code and CLI run unchanged;
the baselines install the same probe in their own workers."""

import os

if os.environ.get("ZT_BENCH_PROBE") and "RANK" in os.environ:
    from train_probe import install

    install(os.environ["ZT_BENCH_PROBE"])
