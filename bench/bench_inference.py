"""Inference benchmark: Q8_0 GGUF with llama-cpp-python vs transformers `generate`, same model, same machine.

    .venv/bin/python bench/bench_inference.py [--model runs/tiny/model]

Both run greedy decoding of the same number of new tokens from the same prompt, on one thread each by default
(`--threads`): this compares the engines' kernels per core. With their default thread pools on this 2-vCPU
VM, identical calls scattered by up to 3x (llama.cpp: a 128-token prefill took 5.1-28.8 ms over 30 calls at
2 threads, 5.9-10.1 ms at 1), so more threads measured the scheduler more than the engines. On the T4
target the GPU does this work; these CPU figures are context, not a T4 prediction.

HF prefill is timed with logits for the last position only (as generate() and llama.cpp compute them).
Each engine lives in its own process (in one process torch's OpenMP workers kept spinning and slowed
llama.cpp at random), started once and driven over a pipe, one call at a time, the engines taking turns
call by call (who goes first rotates). So each pair of timings is taken within milliseconds (prefill) or
about two seconds (decode) of each other, and the load from other guests on this shared VM, which drifts
over seconds to minutes, hits both sides of a ratio alike. (Fresh processes per repeat, tens of seconds
apart, gave per-repeat prompt ratios from 0.67x to 1.01x within one run.) A prefill turn is a warm-up call
and the median of a burst of 5 (right after the other engine ran, the first call finds its weights out of
cache). Every round gives a ratio; the rounds form `--repeats` consecutive groups, whose medians are reported
with their spread. A second llama.cpp process takes its turn in every round too: llama.cpp against itself
(A/A) is the noise floor of the measurement on this machine, reported next to each ratio. With no trained
model it benchmarks a random model of the same tiny architecture (speed does not depend on the weights).
Writes bench/results/inference.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_env import REPO  # first: the hub offline, src/ on the path

from bench_stats import Steal, fmt_ratio, pct, ratio_stats  # noqa: E402

# worker reply key -> metric suffix: wall-clock time, and the worker's CPU time (its one thread), which leaves
# out what the hypervisor stole
CLOCKS = {"seconds": "tokens_per_s", "cpu_seconds": "tokens_per_cpu_s"}
METRICS = [f"{w}_{m}" for m in CLOCKS.values() for w in ("prompt", "decode")]
PREFILL_BURST = 5  # timed prefills per turn (after one warm-up); the turn reports their median
LABELS = {"hf": "transformers generate (fp32)", "gguf": "llama-cpp-python Q8_0"}


def random_tiny_model(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(REPO / "configs/models/tiny_llama31.json"))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(str(REPO / "assets/tokenizer/llama3_1")).save_pretrained(out)
    return out


class HFEngine:
    def __init__(self, model_dir: Path, prompt_ids: list[int], n_new: int, threads: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        self.torch, self.n_new = torch, n_new
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.ids = torch.tensor([prompt_ids])
        self.info = {"threads": torch.get_num_threads()}
        self._generate(4)  # warm-up: first-call costs

    def _generate(self, n: int) -> tuple[float, float]:
        t0 = _clock()
        with self.torch.no_grad():
            self.model.generate(input_ids=self.ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=0)
        return _since(t0)

    def prefill(self) -> tuple[float, float]:
        # logits for the last position only, as generate() and llama.cpp compute them: full logits would
        # multiply the prompt by the 128k-row LM head, which dominates a tiny model's prefill
        t0 = _clock()
        with self.torch.no_grad():
            self.model(input_ids=self.ids, logits_to_keep=1)
        return _since(t0)

    def decode(self) -> tuple[float, float]:
        """Time of the n_new - 1 decode steps: generate(n) = prefill + (n - 1) steps, generate(1) = prefill."""
        full, one = self._generate(self.n_new), self._generate(1)
        return full[0] - one[0], full[1] - one[1]

    def close(self) -> None:
        pass


class GGUFEngine:
    def __init__(self, gguf: Path, prompt_ids: list[int], n_new: int, threads: int):
        import llama_cpp

        self.prompt_ids, self.n_new = prompt_ids, n_new
        self.llm = llama_cpp.Llama(str(gguf), n_ctx=len(prompt_ids) + n_new + 8, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.info = {"threads": self.llm.n_threads, "threads_batch": self.llm.n_threads_batch}
        self.prefill()  # warm-up

    def _prefill(self) -> None:
        self.llm.reset()  # empty the KV cache so every prefill processes the whole prompt
        self.llm.eval(self.prompt_ids)

    def prefill(self) -> tuple[float, float]:
        t0 = _clock()
        self._prefill()
        return _since(t0)

    def decode(self) -> tuple[float, float]:
        import numpy as np

        self._prefill()
        t0 = _clock()
        tok = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        for _ in range(self.n_new - 1):
            self.llm.eval([tok])
            tok = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
        return _since(t0)

    def close(self) -> None:
        self.llm.close()


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t0: tuple[float, float]) -> tuple[float, float]:
    """(wall, CPU) seconds since t0."""
    t = _clock()
    return t[0] - t0[0], t[1] - t0[1]


def serve(engine: str, path: Path, a) -> None:
    """Worker: load the engine, say ready, then answer 'prefill' (a burst) / 'decode' (one) with their (wall, CPU)
    timings until 'quit'."""
    cls = HFEngine if engine == "hf" else GGUFEngine
    e = cls(path, prompt_ids(a.prompt_tokens), a.new_tokens, a.threads)
    print(json.dumps({"ready": True, **e.info}), flush=True)
    try:
        for line in sys.stdin:
            cmd = line.strip()
            if cmd == "quit":
                break
            if cmd == "prefill":
                # one prefill of a tiny model takes milliseconds and, right after the other engine ran, starts
                # with its weights out of cache: a warm-up call, then the median of a short burst
                e.prefill()
                t = [e.prefill() for _ in range(PREFILL_BURST)]
            elif cmd == "decode":
                t = [e.decode()]
            else:
                raise SystemExit(f"bench_inference worker: unknown command {cmd!r} (prefill, decode or quit)")
            print(json.dumps({"seconds": [x[0] for x in t], "cpu_seconds": [x[1] for x in t]}), flush=True)
    finally:
        e.close()


class Worker:
    def __init__(self, engine: str, path: Path, a, log: Path):
        cmd = [sys.executable, __file__, "--worker", engine, "--path", str(path), "--prompt-tokens",
               str(a.prompt_tokens), "--new-tokens", str(a.new_tokens), "--threads", str(a.threads)]
        env = {**os.environ, "OMP_NUM_THREADS": str(a.threads)}
        self.engine, self.log = engine, log
        with open(log, "w") as err:  # a file, not a pipe: warnings must never block the worker
            self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True,
                                      env=env)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.p.stdout.readline()
        if not line:
            raise SystemExit(f"bench_inference: the {self.engine} worker died (exit {self.p.wait()}):\n"
                             f"{self.log.read_text()[-3000:]}")
        return json.loads(line)

    def time(self, cmd: str) -> dict:
        self.p.stdin.write(cmd + "\n")
        self.p.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.p.poll() is None:
            self.p.stdin.write("quit\n")
            self.p.stdin.flush()
        self.p.wait(timeout=60)


def paired(workers: dict, cmd: str, n: int) -> list[dict]:
    """n rounds of timings, the engines taking turns call by call (who goes first rotates); a prefill turn is a
    burst of PREFILL_BURST timings."""
    out, names = [], list(workers)
    for i in range(n):
        order = names[i % len(names):] + names[:i % len(names)]
        out.append({e: workers[e].time(cmd) for e in order})
    return out


def prompt_ids(n: int) -> list[int]:
    # ids below 21,000: valid in every vocabulary benchmarked (SmolLM2's 49,152, Llama-3's 128,256); the speed
    # of either engine does not depend on which tokens they are
    return [1000 + (i * 37) % 20000 for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "assets/models/smollm2-135m-instruct"),
                    help="HF model folder (SmolLM2 by default; a missing folder: a random tiny model)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2, help="groups of pairs (ratio median and spread over groups)")
    ap.add_argument("--prefills", type=int, default=5, help="prefill pairs per group (each turn a burst)")
    ap.add_argument("--decodes", type=int, default=3, help="decode pairs per group")
    ap.add_argument("--threads", type=int, default=1, help="threads for both engines (see the module docstring)")
    ap.add_argument("--out", default=str(REPO / "bench" / "results"), help="folder for inference.json/.md")
    ap.add_argument("--worker", choices=sorted(LABELS), help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return serve(a.worker, Path(a.path), a)
    from bench_limits import forward_flops_per_token, measure

    from zerotune.quantize import run_converter

    calls = {"prompt": ("prefill", a.prefills, a.prompt_tokens), "decode": ("decode", a.decodes, a.new_tokens - 1)}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(a.model)
        if not (model_dir / "config.json").exists():
            model_dir = random_tiny_model(Path(tmp) / "model")
        gguf = Path(tmp) / "model-q8_0.gguf"
        run_converter(model_dir, "q8_0", gguf)
        gguf_bytes = gguf.stat().st_size
        config = json.loads((model_dir / "config.json").read_text())  # model_dir may be a temporary folder
        limits = measure(model_dir, a.prompt_tokens, seconds=0.5, procs=1)  # the engines' own thread count: 1
        # gguf_aa: a second llama.cpp process on the same file, for the A/A noise floor (llama.cpp vs itself)
        workers = {e: Worker(e.removesuffix("_aa"), p, a, Path(tmp) / f"{e}.log")
                   for e, p in (("hf", model_dir), ("gguf", gguf), ("gguf_aa", gguf))}
        try:
            groups = []
            for rep in range(a.repeats):
                st, g = Steal(), {}
                for what, (cmd, n, tokens) in calls.items():
                    rounds = paired(workers, cmd, n)
                    for clock, m in CLOCKS.items():
                        g[f"{what}_{m}"] = [{e: tokens / statistics.median(t[clock]) for e, t in r.items()}
                                            for r in rounds]
                g["steal"] = st.fraction()
                groups.append(g)
                print(f"bench_inference: group {rep + 1}/{a.repeats}: " + ", ".join(
                    f"{m} {_group_ratio(g[m]):.2f}x (A/A {_group_ratio(g[m], 'gguf_aa'):.2f}x)" for m in METRICS),
                    flush=True)
        finally:
            for w in workers.values():
                w.close()
    med = {e: {m: statistics.median(r[e] for g in groups for r in g[m]) for m in METRICS} for e in LABELS}
    ratio = {m: ratio_stats([_group_ratio(g[m]) for g in groups]) for m in METRICS}
    a_a = {m: ratio_stats([_group_ratio(g[m], "gguf_aa") for g in groups]) for m in METRICS}
    steal = [g["steal"] for g in groups]
    res = {"model": str(model_dir.relative_to(REPO) if model_dir.is_relative_to(REPO) else model_dir), "prompt_tokens": a.prompt_tokens, "new_tokens": a.new_tokens,
           "repeats": a.repeats, "prefill_pairs_per_group": a.prefills, "prefill_burst": PREFILL_BURST,
           "decode_pairs_per_group": a.decodes, "cpus": os.cpu_count(),
           "threads": {e: w.info for e, w in workers.items()}, "median": med, "ratio_gguf_over_hf": ratio,
           "a_a_gguf_over_gguf": a_a, "groups": groups, "cpu_steal_per_group": steal,
           "limits": limits, "of_limit": of_limit(med, limits, config, gguf_bytes, forward_flops_per_token)}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "inference.json").write_text(json.dumps(res, indent=2) + "\n")
    hf_t, gg = res["threads"]["hf"]["threads"], res["threads"]["gguf"]

    def row(label: str, threads: str, e: str) -> str:
        return f"| {label} | {threads} | " + " | ".join(f"{med[e][m]:,.0f}" for m in METRICS) + " |"

    md = ["| engine | threads | prompt tok/s | decode tok/s | prompt tok per CPU-s | decode tok per CPU-s |",
          "|---|---|---:|---:|---:|---:|", row(LABELS["hf"], str(hf_t), "hf"),
          row(LABELS["gguf"], f"{gg['threads']} decode, {gg['threads_batch']} prompt", "gguf"),
          "| **ratio GGUF / HF** | | " + " | ".join(f"**{ratio[m]['median']:.2f}x**" for m in METRICS) + " |",
          "| noise floor: llama.cpp / a second llama.cpp process (A/A) | | "
          + " | ".join(f"{a_a[m]['median']:.2f}x" for m in METRICS) + " |",
          "", f"{a.prompt_tokens}-token prompt, {a.new_tokens} greedy new tokens, {a.threads} thread(s) per engine "
          f"({os.cpu_count()} CPUs; see bench_inference.py on why). Each engine in its own process, the engines taking "
          f"turns call by call: {a.repeats} groups of {a.prefills} prefill rounds (each turn a warm-up and the median "
          f"of {PREFILL_BURST} prefills) and {a.decodes} decode rounds; a group's ratio is the median of its rounds' "
          "ratios. Per CPU-second: the engine's CPU time (one thread), which leaves out the time the hypervisor gave "
          "to other guests; the stable measure on this shared VM (its A/A floor is much tighter than wall-clock's):",
          ""]
    md += [f"- {m.replace('_', ' ')}: {fmt_ratio(ratio[m], 'groups')}; A/A {fmt_ratio(a_a[m], 'groups')}"
           for m in METRICS]
    md += ["- CPU steal per group (hypervisor, /proc/stat): " + ", ".join(pct(x) for x in steal)]
    md += ["", "Against this machine's limits, measured in the same run (bench_limits.py, 1 thread): "
           + limit_lines(res["of_limit"])]
    (out / "inference.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def of_limit(med: dict, limits: dict, config: dict, gguf_bytes: int, flops_per_token) -> dict:
    """Decode reads every weight once per token: tokens/s x GGUF bytes over the measured read bandwidth.
    Prefill is matmul-bound: tokens/s x forward FLOPs per token over the fp32 matmul rate at the model's shapes
    (llama.cpp multiplies Q8_0 blocks with integer dot products, so its fraction of the *fp32* rate may pass 1)."""
    mem, mm = limits["memory_1_thread"], limits["matmul_1_thread"]
    fpt = flops_per_token(config)
    out = {"gguf_bytes": gguf_bytes, "forward_flops_per_token": fpt}
    for e in ("gguf", "hf"):
        out[e] = {"decode_of_read_bandwidth": med[e]["decode_tokens_per_s"] * gguf_bytes / mem["read_bytes_per_s"],
                  "decode_of_read_bandwidth_cpu_s": med[e]["decode_tokens_per_cpu_s"] * gguf_bytes
                  / mem["read_bytes_per_cpu_s"],
                  "prompt_of_fp32_matmul": med[e]["prompt_tokens_per_s"] * fpt / mm["mix_flops_per_s"],
                  "prompt_of_fp32_matmul_cpu_s": med[e]["prompt_tokens_per_cpu_s"] * fpt / mm["mix_flops_per_cpu_s"]}
    # HF decodes fp32 weights: 4 bytes per weight read, not the GGUF's ~1.06
    out["hf"]["decode_of_read_bandwidth"] *= 4 * (fpt / 2) / gguf_bytes
    out["hf"]["decode_of_read_bandwidth_cpu_s"] *= 4 * (fpt / 2) / gguf_bytes
    return out


def limit_lines(o: dict) -> str:
    g, h = o["gguf"], o["hf"]
    return (f"llama.cpp Q8_0 decode reads {o['gguf_bytes'] / 2**20:.0f} MiB per token: "
            f"{g['decode_of_read_bandwidth']:.0%} of the read bandwidth per wall-second "
            f"({g['decode_of_read_bandwidth_cpu_s']:.0%} per CPU-second); transformers fp32 decode "
            f"{h['decode_of_read_bandwidth']:.0%} ({h['decode_of_read_bandwidth_cpu_s']:.0%}). Prompt processing, "
            f"{o['forward_flops_per_token'] / 1e6:.0f} MFLOP per token, against the fp32 matmul rate at the model's "
            f"shapes: transformers {h['prompt_of_fp32_matmul']:.0%} ({h['prompt_of_fp32_matmul_cpu_s']:.0%} per "
            f"CPU-second), llama.cpp {g['prompt_of_fp32_matmul']:.0%} ({g['prompt_of_fp32_matmul_cpu_s']:.0%}; "
            "integer Q8_0 dot products, so not bounded by the fp32 rate).")


def _group_ratio(rounds: list[dict], over: str = "hf") -> float:
    """Median over a group's rounds of the GGUF engine's speed over `over`'s, both taken within the round."""
    return statistics.median(r["gguf"] / r[over] for r in rounds)


if __name__ == "__main__":
    main()
