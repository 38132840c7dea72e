"""`zerotune finetune RECIPE`: HF Trainer + DeepSpeed ZeRO-3, one code path from CPU to 8xV100.

Three processes, in the order they run, each in its own module:

    launch.py    the parent: checks (data, plan, disk), materialises a random-init base, starts torchrun
                 with one process per GPU (or train.cpu_procs CPU processes); reports how the workers ended
    worker.py    every rank: setup -> model -> trainer -> resume -> train -> consolidated save; then the
                 other ranks exit and rank 0 starts finalize
    finalize.py  rank 0, a fresh process: verify the save by reloading it, publish model/ (PEFT: merge)

handoff.py types what they pass each other (probe, run record, stop record, a worker's user error); args.py is the
recipe as TrainingArguments, shared with bench/bench_train.py. This package names no function itself: import each
from its module (`from zerotune.train.launch import launch`).
"""
