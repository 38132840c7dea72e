"""Resume on another number of GPUs: a committed ZeRO-3 checkpoint converted once to DeepSpeed's universal format.

ZeRO-3 partitions the fp32 weights and Adam's m and v by rank, and DeepSpeed loads such a checkpoint only at the
world size that wrote it (deepspeed 0.19.8 runtime/engine.py:4748-4753). Its universal format stores every
parameter whole, one file per state (checkpoint/ds_to_universal.py:543-550); a run whose DeepSpeed config says
`"checkpoint": {"load_universal": true}` cuts its own partition out of each file while loading
(runtime/zero/stage3.py:3653-3802). The launcher (`zerotune finetune`, slurm/job.py preflight) converts before any
worker starts: one process, and no collective waiting on it with a timeout.

    checkpoint-N/                    the committed original: its files are only read
      universal/                     built as universal.tmp/, published by rename; a kill leaves universal.tmp/,
                                     which the next attempt removes before converting again
        global_stepN/zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt, zero/optimizer_state.pt, model_states
        latest_universal             the tag engine.load_checkpoint reads when given none (engine.py:4427-4436)
        trainer_state.json, scheduler.pt, rng_state*.pth   the Trainer's own state, copied
        zerotune_universal.json      written last (Conversion): files and sizes, per-parameter checksums, where
                                     it came from

Rotation removes it with its checkpoint (checkpoint.rotate deletes the whole folder).

    saved_world_if_other   the world size that wrote the checkpoint, when it is not this run's (else None)
    refuse_unresumable     one message when the new world size cannot keep the global batch or the data order
    convert_for            the launcher: reuse or build the conversion for this run's world size
    build_conversion       DeepSpeed's converter, checked, published by rename; a stop (stopping.py) leaves nothing
    require_conversion     every worker: the folder the launcher built, or how to get it
The workers' check of what DeepSpeed loaded from it is train/reshard_load.py.
"""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from . import manifest as mf
from . import stopping
from .batch import BatchError, length_grouped, of_recipe, rows_per_sample
from .checkpoint import CommitMarker, last_committed, saved_world_size
from .errors import UserError
from .layout import layout
from .planner.disk import CONVERT_BYTES_PER_S, tree_bytes

CONVERTED_DIR = "universal"
CONVERTED_MARKER = "zerotune_universal.json"
STATES = ("fp32", "exp_avg", "exp_avg_sq")  # what the ZeRO-3 universal loader reads per parameter (stage3.py:3665)
# The Trainer's own files that a resume reads from the folder it is given (transformers 5.23 trainer.py:1697
# trainer_state.json, :3893-3897 scheduler.pt under DeepSpeed with the Trainer's scheduler, :3847-3858 rng_state*.pth)
TRAINER_FILES = ("trainer_state.json", "scheduler.pt")
CHUNK = 1 << 22  # elements per checksum chunk: bounded memory on an 8B embedding (525M elements)


@dataclass
class Conversion:
    """universal/zerotune_universal.json, written last by build_conversion(): read by conversion_problem() (the files
    still match), convert_for() (what it says about the conversion) and train/reshard_load.py's CheckUniversalLoad
    (the checksums the load must equal)."""
    source: str  # the global_stepN folder converted
    source_world_size: int
    step: int
    elapsed_s: float
    params: dict  # {parameter: {"numel": n, state: [sum x^2, sum i x^2] for state in STATES}} (moments)
    peak_bytes: int  # on disk while DeepSpeed converted
    files: dict[str, int]  # every file but this one, and its size
    bytes: int  # the conversion's size on disk

    def write(self, folder: Path) -> None:
        mf.write(Path(folder) / CONVERTED_MARKER, asdict(self))

    @classmethod
    def read(cls, folder: Path) -> Conversion | None:
        d = mf.read(Path(folder) / CONVERTED_MARKER)
        return cls(**d) if d else None


def procs(n: int) -> str:
    return f"{n} process" if n == 1 else f"{n} processes"


def staging_folder(ckpt: Path) -> Path:
    return Path(ckpt) / f"{CONVERTED_DIR}.tmp"


def converted_folder(ckpt: Path) -> Path:
    return Path(ckpt) / CONVERTED_DIR


def tag_of(ckpt: Path) -> str:
    return (Path(ckpt) / "latest").read_text().strip()  # DeepSpeed's own pointer to global_stepN (engine.py:4428)


def conversion_problem(ckpt: Path) -> str | None:
    """Why checkpoint-N has no usable universal conversion, or None when it has one whose files match its marker."""
    marker = Conversion.read(converted_folder(ckpt))
    if marker is None:
        return "not converted"
    for rel, size in marker.files.items():
        f = converted_folder(ckpt) / rel
        if not f.is_file() or f.stat().st_size != size:
            return f"{rel} is missing or truncated"
    return None


def saved_world_if_other(ckpt: Path | None, world: int) -> int | None:
    """The world size that wrote `ckpt` when it differs from `world` (a conversion is needed), else None."""
    saved = saved_world_size(ckpt) if ckpt is not None else None
    return saved if saved is not None and saved != world else None


def refuse_other_batch(r, ckpt: Path) -> None:
    """Refuse, in one message, to resume with another global batch, at any world size: the Trainer skips
    step x grad-accum micro-batches per rank, which is the checkpoint's data position only at its own batch."""
    marker = CommitMarker.read(ckpt)
    was = marker.global_batch_tokens if marker else None  # None: an older marker, without the batch
    if was is not None and was != r.train.global_batch_tokens:
        raise UserError(
            f"{ckpt} was trained with train.global_batch_tokens={was:,} and this run asks for "
            f"{r.train.global_batch_tokens:,}: the data position and learning-rate schedule it resumes assume the "
            f"checkpoint's batch. Resume with train.global_batch_tokens={was}, or move {Path(ckpt).parent} away.")


def refuse_unresumable(r, ckpt: Path, saved: int, world: int) -> None:
    """Refuse, in one message, a world-size change that cannot keep the global batch or the data order."""
    refuse_other_batch(r, ckpt)
    if length_grouped(r):
        raise UserError(
            f"{ckpt} was written by {procs(saved)} and this run has {world}: with data.packing=false the Trainer "
            "orders each epoch by length in groups of micro-batch x grad-accum sequences (transformers 5.23 "
            "trainer.py:1100-1104, trainer_pt_utils.py:497-506), so another grad-accum reorders the epoch and the "
            f"resumed run would repeat some sequences and skip others. Resume with {procs(saved)} "
            f"(train.cpu_procs={saved} on CPU).")
    try:
        of_recipe(r, world)
    except BatchError:
        per_step = r.train.global_batch_tokens // (r.data.seq_len * r.train.micro_batch_size * rows_per_sample(r))
        sp = r.train.sequence_parallel  # a group of sp ranks shares each row: the world is sp x a divisor of per_step
        ok = [d * sp for d in range(1, per_step + 1) if per_step % d == 0]
        near = sorted(ok, key=lambda w: (abs(w - world), w))[:2]
        raise UserError(
            f"{ckpt} was written by {procs(saved)} with a global batch of {r.train.global_batch_tokens:,} tokens "
            f"({per_step} micro-batches of {r.train.micro_batch_size} x {r.data.seq_len} tokens); {world} processes "
            f"cannot split it evenly, so gradient accumulation cannot keep it. Resume with a process count that "
            f"divides {per_step}: {' or '.join(map(str, sorted(near)))} (train.cpu_procs on CPU; "
            f"all: {', '.join(map(str, ok))}).") from None


def convert_for(r, world: int, free_needed: int = 0, convert_by: float | None = None) -> Path | None:
    """In the launcher, before any worker: when the newest committed checkpoint was written at another world size,
    make sure it has a universal conversion (build it once, or reuse it) and return its folder; else None.
    free_needed: what the rest of the run still needs on output_dir's file system after the conversion (the
    launch's plan, Plan.disk.needed_free_bytes). convert_by: when a conversion must have ended (build_conversion)."""
    ckpt = last_committed(layout(r).checkpoints, quiet=True)
    if ckpt is not None:
        refuse_other_batch(r, ckpt)  # at the same world size too
    saved = saved_world_if_other(ckpt, world)
    if saved is None:
        return None
    refuse_unresumable(r, ckpt, saved, world)
    half = staging_folder(ckpt)
    if half.exists():
        shutil.rmtree(half)
        print(f"finetune: removed a half-built universal conversion of {ckpt.name} (an earlier attempt stopped "
              "while converting)", flush=True)
    why = conversion_problem(ckpt)
    if why is None:
        print(f"finetune: {ckpt.name} was written by {procs(saved)} and this run has {world}: resuming from its "
              f"universal conversion ({converted_folder(ckpt)}, built earlier)", flush=True)
    else:
        if why != "not converted":
            print(f"finetune: the universal conversion of {ckpt.name} is unusable ({why}): converting again", flush=True)
        _refuse_without_time(ckpt, saved, convert_by)  # before saying it converts
        print(f"finetune: {ckpt.name} was written by {procs(saved)} and this run has {world}: converting it once "
              f"to DeepSpeed's universal format in {converted_folder(ckpt)} (the original is only read)", flush=True)
        m = build_conversion(ckpt, saved, free_needed=free_needed, convert_by=convert_by)
        print(f"finetune: converted in {m.elapsed_s:.1f} s: {m.bytes / 1e9:.2f} GB beside {ckpt.name} (fp32 "
              f"weights, Adam m and v of {sum(p['numel'] for p in m.params.values()):,} parameters; "
              f"{m.peak_bytes / 1e9:.2f} GB at the peak of the conversion)", flush=True)
    _rng_files(ckpt, converted_folder(ckpt), saved, world)
    return converted_folder(ckpt)


def build_conversion(ckpt: Path, saved_world: int, free_needed: int = 0, convert_by: float | None = None) -> Conversion:
    """Build checkpoint-N/universal/ beside the original and publish it by rename; returns its marker.
    convert_by: the unix time a conversion must have ended by (slurm/job.py: the job's time-limit warning, whose
    USR1 stops it), or None; a conversion estimated not to end by then is refused before it starts.
    A stop (SIGUSR1, SIGTERM: stopping.stoppable) while converting removes the half-built folder and raises
    stopping.Stopped."""
    ckpt = Path(ckpt)
    tag = tag_of(ckpt)
    src = ckpt / tag
    shards = sorted(src.glob("*zero_pp_rank_*_optim_states.pt"))
    size = sum(f.stat().st_size for f in shards)
    estimate = size / CONVERT_BYTES_PER_S
    _refuse_without_time(ckpt, saved_world, convert_by)
    # DeepSpeed writes every fragment to a temp folder, then the merged files and a whole copy of rank 0's shard
    # beside them, and removes the temp folder last (ds_to_universal.py:1318-1353); the result stays held until
    # this checkpoint rotates away, while the run goes on needing what disk_preflight counted.
    peak = 2 * size + size // saved_world
    shutil.rmtree(staging_folder(ckpt), ignore_errors=True)  # a half-built earlier attempt is not space this one needs
    free = shutil.disk_usage(ckpt).free
    if free < max(peak, size + free_needed):
        raise UserError(f"{ckpt.parent} has {free / 2**30:.1f} GiB free; converting {ckpt.name} to another world size "
                        f"needs {peak / 2**30:.1f} GiB while it runs and keeps {size / 2**30:.1f} GiB beside it, "
                        f"and the run needs {free_needed / 2**30:.1f} GiB more after it. Free space, or resume with "
                        f"{procs(saved_world)}.")
    if stopping.asked():  # a stop came during the preflight, before this: do not begin
        raise stopping.Stopped(stopping.asked(), f"before converting {ckpt.name} to DeepSpeed's universal format "
                                                f"(estimated ~{_minutes(estimate)}); {ckpt.name} is intact")
    tmp = staging_folder(ckpt)
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.time()
    try:
        with stopping.stoppable():
            try:
                fields = _build(ckpt, tag, shards, tmp, saved_world, peak, t0)
            except BaseException:
                stopping.hold()  # a second stop must not cut the removal short
                shutil.rmtree(tmp, ignore_errors=True)  # nothing half-built is left for the next attempt
                raise
    except stopping.Stopped as e:
        raise stopping.Stopped(e.signal, f"{time.time() - t0:.0f} s into converting {ckpt.name} to DeepSpeed's "
                                        f"universal format (estimated ~{_minutes(estimate)}): the half-built "
                                        f"conversion was removed and {ckpt.name} is intact") from None
    marker = Conversion(**fields, bytes=tree_bytes(tmp))
    marker.write(tmp)
    mf.publish(tmp, converted_folder(ckpt))  # fsync, then rename: a reader sees no conversion or a whole one
    return marker


def _build(ckpt: Path, tag: str, shards: list[Path], tmp: Path, saved_world: int, peak: int, t0: float) -> dict:
    """DeepSpeed's conversion into tmp/, checked against the original shards; returns the Conversion record's
    fields but its size (build_conversion measures it once the build is whole)."""
    from deepspeed.checkpoint import ds_to_universal

    from . import faults

    src = ckpt / tag
    tmp.mkdir(parents=True)
    with _regex_safe_alias(src, tmp) as (src_alias, tmp_alias):
        args = _Args(input_folder=str(src_alias), output_folder=str(tmp_alias / tag),
                     # one process each: no fork of this launcher (which has torch loaded), and host memory bounded
                     # by one rank's shard (extract) and one parameter's fragments (merge)
                     num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                     # ZeRO-3 needs no universal_checkpoint_info (DeepSpeed #5430 is ZeRO-1/2: ds_to_universal.py:1167-1171)
                     inject_missing_state=False)
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                ds_to_universal.main(args)  # prints progress bars: kept out of the job log, shown if it fails
        except Exception as e:
            raise RuntimeError(f"DeepSpeed's universal conversion of {src} failed ({e}); {ckpt} is intact. Its "
                               f"output:\n{out.getvalue()[-3000:]}") from e
    faults.kill_while_converting()
    faults.slow_conversion()
    _slim_optimizer_state(tmp / tag / "zero" / "optimizer_state.pt")
    params = _checksums(tmp / tag / "zero")
    _compare_with_shards(shards, params, src)
    for name in TRAINER_FILES:
        if (ckpt / name).is_file():
            shutil.copy2(ckpt / name, tmp / name)
    return dict(source=str(src), source_world_size=saved_world, step=_step(tag), elapsed_s=round(time.time() - t0, 2),
                params=params, peak_bytes=peak,
                files={str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()})


# What DeepSpeed's converter may meet in a path without harm: it builds a glob and a regex from the unescaped path
# (ds_to_universal.py:251 glob.glob(f"{prefix_path}.*"), :260 re.compile(f"{prefix_path}\\.([0-9]+)"), :1064 the
# input folder's glob), so `[1]` is a glob character class and `(copy)+` a regex group in a run folder's name.
# A "." stays safe: as a regex it matches itself too.
_SAFE_PATH = re.compile(r"[A-Za-z0-9_./-]+")


@contextlib.contextmanager
def _regex_safe_alias(src: Path, out: Path):
    """(src, out) as symlinks in a fresh temp folder whose own path DeepSpeed's globs and regexes read literally.
    Everything the converter writes goes through the `out` link into `out` itself, beside the checkpoint; its
    `latest_universal` too (written into the output folder's parent, ds_to_universal.py:1374-1377)."""
    import tempfile

    base = Path(tempfile.mkdtemp(prefix="zerotune-universal-"))
    try:
        if not _SAFE_PATH.fullmatch(str(base)):
            raise UserError(f"the temp folder {base} has characters DeepSpeed's universal converter reads as glob or "
                            f"regex syntax (it has no escaping): set TMPDIR to a folder whose path has only letters, "
                            f"digits and _ . / - (e.g. TMPDIR=/tmp), then resubmit.")
        (base / "src").symlink_to(Path(src).resolve(), target_is_directory=True)
        (base / "out").symlink_to(Path(out).resolve(), target_is_directory=True)
        yield base / "src", base / "out"
    finally:
        for link in ("src", "out"):
            (base / link).unlink(missing_ok=True)  # the links, never what they point to
        base.rmdir()


@contextlib.contextmanager
def glob_safe(folder: Path):
    """`folder`, or an alias of it that glob reads literally: transformers finds a DeepSpeed checkpoint to resume with
    glob.glob(f"{checkpoint_path}/global_step*") (integrations/deepspeed.py deepspeed_load_checkpoint, unescaped), so
    a run folder named `run [1]` resumes nothing. The alias is a symlink in a fresh temp folder, kept while the
    caller loads (the worker: the whole trainer.train call)."""
    import glob

    if glob.escape(str(folder)) == str(folder):
        yield Path(folder)
        return
    with _regex_safe_alias(folder, folder) as (alias, _):
        yield alias


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} min"


def _refuse_without_time(ckpt: Path, saved_world: int, convert_by: float | None) -> None:
    """Refuse a conversion estimated not to end before `convert_by` (None: no limit): started, the warning would
    stop it and throw it away, and a requeued job with the same time limit would do the same again."""
    if convert_by is None:
        return
    size = sum(f.stat().st_size for f in (Path(ckpt) / tag_of(ckpt)).glob("*zero_pp_rank_*_optim_states.pt"))
    estimate = size / CONVERT_BYTES_PER_S
    need = stopping.seconds_needed(estimate, 0)  # the workers' rule for a step: 10% and a minute in hand
    left = convert_by - time.time()
    if need <= left:
        return
    raise UserError(
        f"{ckpt} was written by {procs(saved_world)}: converting it for this job takes ~{_minutes(estimate)} "
        f"(an estimate: {size / 1e9:.2f} GB of optimizer state at {CONVERT_BYTES_PER_S / 1e6:g} MB/s; "
        f"~{_minutes(need)} with the margin), but this job has {_minutes(max(left, 0))} left before its time-limit "
        f"warning (--signal=B:USR1), which would stop the conversion and throw it away: not started, and not "
        f"requeued (the next attempt would have no more time). Resubmit with a --time at least "
        f"{_minutes(need - left + 60)} longer (the conversion is kept for later jobs), or on {procs(saved_world)} "
        f"(the number of GPUs that wrote it), which resumes without converting.")


class _Args:
    """ds_to_universal.main's argparse namespace (ds_to_universal.py:71-98), built without its argv parser."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def _step(tag: str) -> int:
    m = re.search(r"(\d+)$", tag)
    return int(m.group(1)) if m else -1


def _slim_optimizer_state(path: Path) -> None:
    """DeepSpeed copies rank 0's whole optimizer shard into zero/optimizer_state.pt (ds_to_universal.py:1016-1022:
    its m, v and fp32 partitions, 12 B per parameter / the old world size; loaded to the CPU first, :1017), and every
    rank of the resumed run loads that file whole into host RAM (stage3.py:3660): at 8B from 8 GPUs, 12 GB per
    rank, 96 GB per node. The loader reads only the loss scaler, the Adam step and the hyper-parameters from it
    (stage3.py:3662-3691); keep those."""
    import torch

    sd = torch.load(path, map_location="cpu", weights_only=False)
    inner = sd["optimizer_state_dict"]
    inner["state"] = {k: {"step": v["step"]} for k, v in inner["state"].items() if "step" in v}
    sd.pop("fp32_flat_groups", None)
    torch.save(sd, path)


def moments(x, start: int = 0) -> tuple[float, float]:
    """(sum of x^2, sum of i * x^2) in float64, i the element's index in the whole parameter (`start` for x[0]):
    the second changes when a partition lands at the wrong offset, which the first cannot see."""
    import torch

    x = x.reshape(-1)
    s2 = si2 = 0.0
    for i in range(0, x.numel(), CHUNK):
        c = x[i:i + CHUNK].detach().double().square()
        s2 += float(c.sum())
        si2 += float(torch.dot(c, torch.arange(start + i, start + i + c.numel(), dtype=torch.float64, device=c.device)))
    return s2, si2


def _checksums(zero: Path) -> dict:
    import torch

    params = {}
    for d in sorted(p for p in zero.iterdir() if p.is_dir()):
        row = {}
        for state in STATES:
            t = torch.load(d / f"{state}.pt", map_location="cpu", weights_only=False)
            t = t["param"] if isinstance(t, dict) else t
            row["numel"] = t.numel()
            row[state] = moments(t)
        params[d.name] = row
    return params


def _compare_with_shards(shards: list[Path], params: dict, src: Path) -> None:
    """The conversion holds what the original holds: per state, the sum of squares over every rank's shard equals
    the sum over the converted parameters. A dropped, duplicated or zeroed fragment fails. Only each partition's
    padding-free elements count, as DeepSpeed converts them (ds_to_universal.py:194-210): the tail of the last
    partition is not zeros (partition_parameters.py:1836 allocates it with torch.empty and :1872-1876 copies only
    the real elements), which a world size that does not divide a tensor (24 or 48 GPUs at 8B) would expose."""
    import torch
    from deepspeed.checkpoint.constants import PARAM_SHAPES
    from deepspeed.checkpoint.ds_to_universal import _shape_numel, _zero3_rank_from_file, _zero_partitioned_param_info

    total = dict.fromkeys(STATES, 0.0)
    for f in shards:
        rank = _zero3_rank_from_file(f)
        model = next(src.glob(f"*zero_pp_rank_{rank}_mp_rank_*_model_states.pt"))
        shapes = torch.load(model, map_location="cpu", weights_only=False)[PARAM_SHAPES]
        sd = torch.load(f, map_location="cpu", weights_only=False, mmap=True)["optimizer_state_dict"]
        groups = sd.get("ds_zero_partition_groups") or []
        for i, flat in enumerate(sd["fp32_flat_groups"]):
            states = {"fp32": flat.reshape(-1), **{s: sd["optimizer_state_dict"]["state"][i][s].reshape(-1)
                                                  for s in ("exp_avg", "exp_avg_sq")}}
            meta = groups[i] if i < len(groups) else {}
            count, prank = meta.get("partition_count", len(shards)), meta.get("partition_rank", rank)
            offset = 0
            for shape in shapes[i].values():
                numel = _shape_numel(shape)
                part, _ = _zero_partitioned_param_info(numel, count)
                valid = max(0, min(part, numel - prank * part))
                for state, t in states.items():
                    total[state] += moments(t.narrow(0, offset, valid))[0]
                offset += part
        del sd
    for state in STATES:
        conv = sum(p[state][0] for p in params.values())
        if not close_enough(conv, total[state]):
            raise RuntimeError(f"the universal conversion of {src} does not hold its {state}: sum of squares "
                               f"{conv!r} against {total[state]!r} in the original shards; the original is intact")


def close_enough(a: float, b: float, rel: float = 1e-9) -> bool:
    """Float64 sums of the same fp32 values taken in another order: relative error ~ n x 2^-53 at worst."""
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-300)


def _rng_files(ckpt: Path, folder: Path, saved: int, world: int) -> None:
    """The Trainer restores rank r's RNG from rng_state_r.pth (rng_state.pth at world 1: trainer.py:3847-3858).
    Every rank is seeded alike (set_seed(args.seed)), so new rank r takes old rank r % saved's state."""
    def name(rank: int, w: int) -> str:
        return "rng_state.pth" if w == 1 else f"rng_state_{rank}.pth"

    for rank in range(world):
        src, dst = ckpt / name(rank % saved, saved), folder / name(rank, world)
        if src.is_file() and not dst.is_file():
            mf.write_atomic(dst, src.read_bytes())  # a few KB of RNG state each


def require_conversion(ckpt: Path, saved: int, world: int) -> Path:
    """In every worker: the conversion the launcher built, or one message saying how to get it."""
    why = conversion_problem(ckpt)
    if why is not None:
        raise UserError(f"{ckpt} was written by {procs(saved)} and this run has {world}, and its universal "
                        f"conversion is {why}: start training with `zerotune finetune` or slurm/finetune.sbatch, "
                        f"which convert it first, or resume with {procs(saved)}.")
    return converted_folder(ckpt)
