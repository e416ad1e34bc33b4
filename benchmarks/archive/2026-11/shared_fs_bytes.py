"""Bytes each node reads from the shared file system per epoch, by data order, nodes and data-set size. Prints a table.

    python benchmarks/archive/2026-11/shared_fs_bytes.py [--nodes 1,2,4,8,16,32,64] [--ranks-per-node 8]
        [--per-rank 32] [--sets cifar10,celebamask,imagenet] [--shard-mb 256] [--block-kb 1024]

Computed from the read plan, not by running 64 nodes: the epoch order is hpctrain's own
(``shard_epoch_order`` for data.order=exact, ``shard_local_order`` for shard_local), cut into steps and ranks by
``StepBatchSampler.step_indices`` as training cuts it; each sample's bytes map to the aligned blocks that
``BlockReader`` reads (``data.read_block_kb``). A node reads a block from the shared file system once per epoch:
the node's page cache serves its other processes and a block's re-reads. That holds when the page cache keeps
about two shuffle windows' blocks (a block's samples lie in one or two adjacent windows, consumed in adjacent
steps): for the exact order two windows per node, for shard_local two per rank (each rank has its own stream; 8
ranks x 2 x 450 MB = 7 GB for ImageNet's 110 KB samples); with less, more is read. The label member of a sample
(a few bytes in the same block as its image) is left out. Staging (data.stage_dir) copies the whole split once per node and
job, then reads nothing shared, whatever the order.

The data sets are synthetic layouts (no data needed): a number of samples of a fixed size packed as tar records
(512-byte header per member, padded to 512) into shards of --shard-mb, like ``hpctrain shard`` writes them.
Weak scaling: the global batch is nodes x ranks per node x per-rank samples.
"""

from __future__ import annotations

import argparse
import functools
from typing import NamedTuple

import numpy as np
import torch

from hpctrain.config.batch import batch_sizes
from hpctrain.data.sampler import StepBatchSampler
from hpctrain.data.shard_local import RankLayout, shard_local_order
from hpctrain.data.shardset import shard_epoch_order


class DataSet(NamedTuple):
    name: str
    samples: int
    sample_bytes: int
    """Bytes of a sample's image; a class label member (one header + one padded block) is added."""


SETS = {
    "cifar10": DataSet("CIFAR-10 (PNG)", 50_000, 2_500),
    "celebamask": DataSet("CelebAMask-HQ 512 (JPEG + label PNG)", 28_000, 110_000),
    "imagenet": DataSet("ImageNet-1k (JPEG)", 1_281_167, 110_000),
}
ORDERS = ("exact", "shard_local")
MAX_DROPPED = 0.1
"""Configurations whose partial last global batch (dropped) exceeds this share of an epoch are not shown: their
'x set' would count a set they do not read."""


class Layout(NamedTuple):
    """Where each sample's bytes are: shard, offset and length, and each shard's size."""

    shard: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    shard_bytes: np.ndarray

    @property
    def sizes(self) -> list[int]:
        return np.bincount(self.shard, minlength=len(self.shard_bytes)).tolist()


def _padded(n: int) -> int:
    return 512 + -(-n // 512) * 512


def tar_layout(ds: DataSet, shard_bytes: int) -> Layout:
    """Samples packed in order into tar shards of at most shard_bytes (the image member first)."""
    record = _padded(ds.sample_bytes) + _padded(2)  # image + label members
    per_shard = max(1, shard_bytes // record)
    i = np.arange(ds.samples)
    shard, slot = i // per_shard, i % per_shard
    counts = np.bincount(shard)
    return Layout(shard, slot * record + 512, np.full(ds.samples, ds.sample_bytes), counts * record + 1024)


def node_bytes(layout: Layout, order: torch.Tensor, nodes: int, ranks_per_node: int, per_rank: int,
               block: int) -> np.ndarray:
    """Bytes read from the shared file system by each node in one epoch: its distinct blocks."""
    plan = batch_sizes(nodes * ranks_per_node * per_rank, per_rank, nodes * ranks_per_node)
    steps = len(order) // plan.global_batch_size
    out = np.zeros(nodes)
    # Per-shard block ids made global, so that one unique() counts a node's blocks.
    blocks_per_shard = -(-layout.shard_bytes // block)
    first_block = np.concatenate([[0], np.cumsum(blocks_per_shard)[:-1]])
    last_len = layout.shard_bytes - (blocks_per_shard - 1) * block  # the partial last block of each shard
    for node in range(nodes):
        mine = []
        for local in range(ranks_per_node):
            sampler = StepBatchSampler(len(order), plan, node * ranks_per_node + local, seed=0,
                                       order=lambda *_: order)
            mine.extend(i for k in range(steps) for i in sampler.step_indices(order, k))
        idx = np.asarray(mine)
        s, a, b = layout.shard[idx], layout.offset[idx] // block, (layout.offset[idx] + layout.length[idx] - 1) // block
        spans = [np.arange(x, y + 1) + first_block[sh] for sh, x, y in zip(s, a, b)]
        touched = np.unique(np.concatenate(spans))
        shard_of = np.searchsorted(first_block, touched, side="right") - 1
        is_last = touched == first_block[shard_of] + blocks_per_shard[shard_of] - 1
        out[node] = np.where(is_last, last_len[shard_of], block).sum()
    return out


@functools.lru_cache(maxsize=None)
def _order(kind: str, sizes: tuple[int, ...], nodes: int, ranks_per_node: int, per_rank: int, window: int) -> torch.Tensor:
    if kind == "exact":
        return shard_epoch_order(sizes, 0, 0, window)
    return shard_local_order(sizes, 0, 0, window, RankLayout(nodes * ranks_per_node, per_rank))


def rows(args: argparse.Namespace, notes: list[str]):
    for key in args.sets.split(","):
        ds = SETS[key]
        layout = tar_layout(ds, args.shard_mb << 20)
        total = float(layout.shard_bytes.sum())
        for nodes in (int(n) for n in args.nodes.split(",")):
            batch = nodes * args.ranks_per_node * args.per_rank
            if ds.samples % batch > MAX_DROPPED * ds.samples:  # also: batch > samples
                notes.append(f"# {ds.name}, {nodes} nodes: not shown, an epoch of {ds.samples // batch} global "
                             f"batches of {batch} drops {ds.samples % batch / ds.samples:.0%} of the samples")
                continue
            per_order = {}
            for kind in ORDERS:
                order = _order(kind, tuple(layout.sizes), nodes, args.ranks_per_node, args.per_rank, args.window)
                per_order[kind] = node_bytes(layout, order, nodes, args.ranks_per_node, args.per_rank,
                                             args.block_kb << 10)
            yield ds, len(layout.shard_bytes), total, nodes, per_order


def _gb(x: float) -> str:
    return f"{x / 1e9:.3g}"


def table(args: argparse.Namespace) -> str:
    head = ("| data set | size (GB) | shards | nodes | exact: GB per node (x set) | shard_local: GB per node (x set) "
            "| exact: all nodes (x set) | shard_local: all nodes (x set) | staged: GB per node per job |")
    lines, notes = [head, "|" + "---|" * (head.count("|") - 1)], []
    for ds, shards, total, nodes, b in rows(args, notes):
        ex, sl = b["exact"], b["shard_local"]
        lines.append(f"| {ds.name} | {_gb(total)} | {shards} | {nodes} | {_gb(ex.mean())} ({ex.mean() / total:.2f}) "
                     f"| {_gb(sl.mean())} ({sl.mean() / total:.3f}) | {ex.sum() / total:.1f} | {sl.sum() / total:.2f} "
                     f"| {_gb(total)} |")
    return "\n".join(lines + notes)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1,2,4,8,16,32,64")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--per-rank", type=int, default=32, help="samples per rank per optimizer step")
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--shard-mb", type=int, default=256)
    p.add_argument("--block-kb", type=int, default=1024, help="data.read_block_kb")
    p.add_argument("--window", type=int, default=4096, help="data.shuffle_window")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    print(f"# bytes from the shared file system per node and epoch; {args.ranks_per_node} ranks per node, "
          f"{args.per_rank} samples per rank and step, shards of {args.shard_mb} MB, blocks of {args.block_kb} KB, "
          f"shuffle window {args.window}")
    print(table(args))


if __name__ == "__main__":
    main()
