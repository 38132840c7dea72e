"""Sequence parallelism keeps the arithmetic exact: two packed rows trained by 2 ranks that each hold half of every
row give the loss and every parameter's gradient of the same rows trained unsplit, for each model family zerotune
trains (Llama, Qwen3, Gemma 3 with a sliding window shorter than a document that crosses the shard boundary).

Method. This file is its own torchrun worker on 2 CPU ranks (gloo runs DeepSpeed's all-to-all). Each rank builds
the same tiny model in fp32 with zerotune's `sdpa_docs` attention and the same two packed rows (documents of 20, 30
and 14 tokens in a 64-token row: the 30-token one crosses the boundary at 32; the first token of every document and
a few prompt tokens carry no label, so the two halves hold different numbers of labels). The reference is the
unsplit rows' loss summed over all their label tokens, and its gradients, computed before anything is registered
(DeepSpeed's wrapper replaces sdpa_docs process-wide). Then the path training takes: UlyssesSPAttentionHF over
sdpa_docs (accelerate's registration call, train/sequence_parallel.py), each rank loads one row and
UlyssesSPDataLoaderAdapter shares both with both ranks, sliced, labels shifted first; each slice's loss is
train/sequence_parallel.shard_loss over the step's label tokens counted on both ranks, backward; the gradients are
averaged over the ranks as DeepSpeed averages them. Loss and every gradient must equal the reference within fp32
rounding."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from zero3_cpu import launch

REPO = Path(__file__).resolve().parents[1]
FAMILIES = {  # the repository's tiny configs, with a small vocabulary; Gemma 3's window shorter than a document
    "llama": ("tiny_llama31.json", {}),
    "qwen3": ("tiny_qwen3.json", {}),
    "gemma3": ("tiny_gemma3.json", {"num_hidden_layers": 2, "sliding_window": 8,
                                    "layer_types": ["sliding_attention", "full_attention"]}),
}
DOCS = (20, 30, 14)  # one row: the 30-token document spans positions 20-49, across the half at 32
SEQ = sum(DOCS)


def _rows(vocab: int):
    import torch

    g = torch.Generator().manual_seed(0)
    rows = []
    for r in range(2):
        ids = torch.randint(3, vocab, (1, SEQ), generator=g)
        pos = torch.cat([torch.arange(d) for d in DOCS]).unsqueeze(0)
        labels = ids.clone()
        labels[pos == 0] = -100  # a document's first token has no label
        labels[0, 21 + r: 26 + 2 * r] = -100  # a prompt inside the crossing document: the halves' counts differ
        rows.append({"input_ids": ids, "position_ids": pos, "labels": labels})
    return rows


def _worker(family: str, out: Path) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerotune import attention
    from zerotune.train.sequence_parallel import shard_loss

    deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    name, extra = FAMILIES[family]
    cfg = AutoConfig.from_pretrained(REPO / "configs" / "models" / name)
    for k, v in {"vocab_size": 512, **extra}.items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention.load_name("sdpa_docs"),
                                             dtype=torch.float32)
    model.train()
    rows = _rows(cfg.vocab_size)

    # the reference: both rows unsplit, token losses summed over all their labels
    labels_total = sum(int((r["labels"][:, 1:] != -100).sum()) for r in rows)
    model.zero_grad()
    ref = sum(model(**r, num_items_in_batch=torch.tensor(labels_total)).loss for r in rows)
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # sequence parallel: what accelerate registers, what the Trainer's loader and loss do
    mpu = UlyssesSPAttentionHF.register_with_transformers(model, core_attn_implementation="sdpa_docs",
                                                          sequence_parallel_size=world, micro_batch_size=1,
                                                          seq_length_is_variable=True, disable_in_eval=True)
    loader = UlyssesSPDataLoaderAdapter([rows[rank]], sp_rank=mpu.get_sequence_parallel_rank(),
                                        sp_group=mpu.get_sequence_parallel_group(),
                                        sp_world_size=mpu.get_sequence_parallel_world_size(), device="cpu")
    shards = list(loader)  # both rows, this rank's half of each
    mine = torch.stack([(s["shift_labels"] != -100).sum() for s in shards]).sum().reshape(1)
    dist.all_reduce(mine)
    model.zero_grad()
    loss = torch.zeros(())
    for s in shards:
        o = shard_loss(model, s, mine[0], world)
        o.loss.backward()
        loss += o.loss.detach() / world
    dist.all_reduce(loss)
    diffs = {}
    for n, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= world  # DeepSpeed averages the ranks' gradients
        diffs[n] = float((g - ref_grads[n]).abs().max() / ref_grads[n].abs().max().clamp(min=1e-12))
    if rank == 0:
        out.write_text(json.dumps({"shards": len(shards), "labels": labels_total, "loss": float(loss),
                                   "ref": float(ref), "grad_rel_diff": diffs}))


@pytest.mark.integration
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_ranks_sharing_each_row_equal_the_unsplit_rows(family, tmp_path):
    out = tmp_path / "sp.json"
    launch(__file__, family, out)
    got = json.loads(out.read_text())
    assert got["shards"] == 2  # both rows, half each
    assert got["loss"] == pytest.approx(got["ref"], rel=1e-6)
    worst = max(got["grad_rel_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-5, worst


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "tests"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker(sys.argv[1], Path(sys.argv[2]))
