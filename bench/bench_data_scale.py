"""Data preparation at scale: `zerotune data` on a 1M-conversation synthetic set, and whether its memory stays flat.

    .venv/bin/python bench/bench_data_scale.py                    # 100,000 then 1,000,000 conversations
    .venv/bin/python bench/bench_data_scale.py --n 20000 --small 2000 --out /tmp/scale   # the smoke test's size

1. Generates N synthetic chats with bench_data's generator, messages shorter than there (`--shorter` lowers the
   log-normal's mean; about 150 tokens per conversation by default): at a million rows the per-row costs (reading,
   validating, rendering, pickling to the workers, writing) are what is measured, bench_data.py measures tokens.
2. Runs `prepare` twice in a child process each (a fresh interpreter, as `make data` runs): on the first
   `--small` rows, then on all N. Meanwhile it samples the resident memory (RSS) of that process and of its
   num_proc tokenizer workers every 0.2 s. Memory that grows with the data set shows up as the difference between
   the two runs' peaks, per document; a bounded prepare keeps it to a few bytes per document.
3. The child reports its own CPU time and its workers': the main process reads, parses and writes every row
   itself, so its CPU-seconds per row bound the rows/s any number of workers can reach.

Writes bench/results/data_scale.json and .md (bench/report.py adds them to bench/results.md).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from bench_env import REPO  # first: the hub offline, src/ on the path

MB = 2**20


def child(recipe_path: str) -> None:
    """In a fresh process: prepare, then one JSON line with this process's and its workers' CPU and peak RSS."""
    import resource

    from zerotune.config import load_recipe
    from zerotune.data.prepare import prepare

    t0 = time.perf_counter()
    m = prepare(load_recipe(recipe_path), rebuild=True, histogram=False)
    wall = time.perf_counter() - t0
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    print("BENCH " + json.dumps({
        "wall_s": wall, "main_cpu_s": me.ru_utime + me.ru_stime, "workers_cpu_s": kids.ru_utime + kids.ru_stime,
        "main_maxrss_mb": me.ru_maxrss / 1024, "largest_worker_maxrss_mb": kids.ru_maxrss / 1024,
        "docs": m["counts"]["docs_out"], "rows": m["counts"]["rows_in"], "tokens": m["tokens"]["train_real"],
        "sequences": m["sequences"]["train"], "timing_s": m["timing_s"],
        "packing_efficiency": m["packing"]["efficiency"]}), flush=True)


def _rss(pid: int) -> tuple[float, float]:
    """(anonymous, file-backed) resident MB of a process (/proc/PID/status). Anonymous memory is what prepare holds;
    file-backed pages are the memory-mapped Arrow files it reads and writes, which the kernel can drop at will, so
    RSS alone would count the data set's size as memory."""
    kb = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssAnon:", "RssFile:")):
                kb[line.split(":")[0]] = int(line.split()[1])
    return kb["RssAnon"] / 1024, kb["RssFile"] / 1024


def sample_rss(pid: int, out: list, stop: threading.Event, every: float = 0.2) -> None:
    """(t, main anonymous MB, main file-backed MB, the workers' anonymous MB summed) until the process ends."""
    import psutil

    t0 = time.perf_counter()
    try:
        p = psutil.Process(pid)
        while not stop.is_set():
            anon, mapped = _rss(pid)
            workers = 0.0
            for c in p.children(recursive=True):
                try:
                    workers += _rss(c.pid)[0]
                except (OSError, KeyError):
                    pass
            out.append((round(time.perf_counter() - t0, 2), anon, mapped, workers))
            time.sleep(every)
    except (psutil.Error, OSError, KeyError):
        pass


def run_prepare(src: Path, n: int, work: Path, args) -> dict:
    import yaml

    data = src if n is None else _head(src, work / f"head{n}.jsonl", n)
    recipe = work / f"scale{n}.yaml"
    recipe.write_text(yaml.safe_dump({
        "name": "bench_scale", "output_dir": str(work / f"run{n}"),
        "model": {"init_config": "configs/models/tiny_llama31.json", "tokenizer": "assets/tokenizer/llama3_1"},
        "data": {"sources": [str(data)], "seq_len": args.seq_len, "packing": True, "num_proc": args.num_proc}}))
    samples: list = []
    stop = threading.Event()
    proc = subprocess.Popen([sys.executable, __file__, "--child", str(recipe)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    th = threading.Thread(target=sample_rss, args=(proc.pid, samples, stop), daemon=True)
    th.start()
    out, _ = proc.communicate()
    stop.set()
    th.join()
    if proc.returncode != 0:
        raise SystemExit(f"bench_data_scale: prepare of {n} rows failed (exit {proc.returncode}):\n{out[-2000:]}")
    res = json.loads(next(x for x in out.splitlines() if x.startswith("BENCH "))[6:])
    res["rss_samples"] = len(samples)
    res["peak_main_anon_mb"] = round(max(s[1] for s in samples), 1)
    res["peak_main_file_mb"] = round(max(s[2] for s in samples), 1)
    res["peak_workers_anon_mb"] = round(max(s[3] for s in samples), 1)
    # the main process's anonymous memory at 25/50/75/95% of the run: flat means bounded
    res["main_anon_timeline_mb"] = [round(samples[min(len(samples) - 1, int(f * len(samples)))][1], 1)
                                    for f in (0.25, 0.5, 0.75, 0.95)]
    res["disk_mb"] = round(sum(f.stat().st_size for f in (work / f"run{n}").rglob("*") if f.is_file()) / MB, 1)
    return res


def _head(src: Path, dst: Path, n: int) -> Path:
    with open(src) as f, open(dst, "w") as g:
        for _ in range(n):
            g.write(next(f))
    return dst


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--n", type=int, default=1_000_000, help="conversations")
    ap.add_argument("--small", type=int, default=100_000, help="the first run's conversations (memory baseline)")
    ap.add_argument("--shorter", type=float, default=1.3, help="lowers bench_data's message-length mean (log-scale)")
    ap.add_argument("--seq-len", type=int, default=16384, help="the 8B recipe's")
    ap.add_argument("--num-proc", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "data_scale"))
    args = ap.parse_args()
    if args.child:
        return child(args.child)

    from bench_data import generate

    load = [os.getloadavg()[1]]  # wall-clock rates mean little on a shared machine: say how busy it was
    with tempfile.TemporaryDirectory(prefix="zt-bench-scale-") as tmp:
        work = Path(tmp)
        src = work / "chat.jsonl"
        t0 = time.perf_counter()
        generate(src, args.n, shorter=args.shorter)
        gen_s = time.perf_counter() - t0
        print(f"bench_data_scale: generated {args.n:,} conversations in {gen_s:.0f} s "
              f"({src.stat().st_size / MB:,.0f} MB)", flush=True)
        small = run_prepare(src, args.small, work, args)
        print(f"bench_data_scale: {args.small:,} rows: {small['wall_s']:.0f} s, main process peak "
              f"{small['peak_main_anon_mb']} MB", flush=True)
        big = run_prepare(src, None, work, args)
        print(f"bench_data_scale: {args.n:,} rows: {big['wall_s']:.0f} s, main process peak {big['peak_main_anon_mb']} MB",
              flush=True)
        source_mb = src.stat().st_size / MB
    load.append(os.getloadavg()[1])

    per_row = lambda r: r["main_cpu_s"] / r["rows"]  # noqa: E731
    growth = (big["peak_main_anon_mb"] - small["peak_main_anon_mb"]) * MB / (big["docs"] - small["docs"])
    res = {
        "conversations": args.n, "small": args.small, "seq_len": args.seq_len, "num_proc": args.num_proc,
        "shorter": args.shorter, "generate_s": round(gen_s, 1), "source_mb": round(source_mb, 1),
        "tokens_per_conversation": round(big["tokens"] / big["docs"], 1),
        "runs": {"small": small, "full": big},
        "rows_per_s": round(big["rows"] / big["wall_s"]),
        "tokens_per_s": round(big["tokens"] / big["wall_s"]),
        "tokens_per_cpu_s": round(big["tokens"] / (big["main_cpu_s"] + big["workers_cpu_s"])),
        "main_cpu_ms_per_row": round(per_row(big) * 1e3, 3),
        "rows_per_s_bound_by_main": round(1 / per_row(big)),
        "rss_growth_bytes_per_document": round(growth, 1),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "load_average_5min": [round(x, 2) for x in load],
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    row = lambda name, r: (f"| {name} | {r['rows']:,} | {r['tokens']:,} | {r['wall_s']:.0f} | "  # noqa: E731
                           f"{r['rows'] / r['wall_s']:,.0f} | {r['main_cpu_s']:.0f} / {r['workers_cpu_s']:.0f} | "
                           f"{r['peak_main_anon_mb']:,.0f} | {r['peak_workers_anon_mb']:,.0f} | "
                           f"{' / '.join(f'{x:,.0f}' for x in r['main_anon_timeline_mb'])} | "
                           f"{r['peak_main_file_mb']:,.0f} | {r['disk_mb']:,.0f} |")
    md = f"""# Data preparation at scale

`zerotune data` in a fresh process on synthetic chats ({res['tokens_per_conversation']} tokens per conversation on
average, bench_data's generator with shorter messages), real Llama-3.1 tokenizer, seq_len {args.seq_len},
num_proc {args.num_proc}, {os.cpu_count()} CPUs, 5-minute load average {load[0]:.1f} at the start and {load[1]:.1f} at the
end (the CPU-second figures hold under load, the wall-clock ones do not). Resident memory sampled every 0.2 s from /proc: anonymous (what
prepare holds; the workers' summed) apart from file-backed pages (the memory-mapped Arrow files being read and
written, which the kernel drops under pressure, so they grow with the data without being needed).

| run | rows | document tokens | wall s | rows/s | CPU-s main / workers | peak main MB | peak workers MB | main MB at 25/50/75/95% of the run | peak main file-backed MB | disk MB |
|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|
{row("first " + f"{args.small:,}", small)}
{row("all", big)}

- **{res['rows_per_s']:,} rows/s** end to end on {args.n:,} conversations ({res['tokens_per_s']:,} tokens/s,
  {res['tokens_per_cpu_s']:,} tokens per CPU-second over all processes).
- Memory: the main process peaked at {big['peak_main_anon_mb']:,.0f} MB for {big['docs']:,} documents against
  {small['peak_main_anon_mb']:,.0f} MB for {small['docs']:,}: **{growth:,.0f} bytes per document** more (the
  per-document lengths and the packing plan); rows are streamed, never held. Each worker holds the tokenizer
  and one chunk: {big['peak_workers_anon_mb']:,.0f} MB for {args.num_proc}.
- The main process spends {res['main_cpu_ms_per_row']} ms of CPU per row (reading, parsing, writing; the
  workers validate, render and tokenize), so more workers help up to about **{res['rows_per_s_bound_by_main']:,}
  rows/s**, whatever the core count.
"""
    out.with_suffix(".md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
