#!/usr/bin/env python3
"""Per-rank entry point for torchtitan 0.3.0 training anyseek's 16B with expert parallelism (under torchrun).

    TT_PEER_DIR=.peers/torchtitan python3 -m torch.distributed.run --standalone --nproc_per_node=N \
        benchmarks/peers/torchtitan/launch_16b.py --module tt_dsv3_16b --config deepseek_v3_16b_ep \
        --parallelism.expert_parallel_degree N [torchtitan CLI overrides]

It reuses the one-GPU harness of the shared peer folder (copied into the checkout, TT_PEER_DIR, default
.peers/torchtitan): that folder's launch.py applies the torch-2.11 shims (each one logged as "[launch] shim
applied: ...") and hands over to torchtitan.train.main(); its tt_dsv3_small.py gives the synthetic data loader and
the loss choice; its tokenizer/ folder is the one torchtitan loads. This file only puts both folders on sys.path.
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def peer_dir() -> str:
    """The copied shared peer folder: TT_PEER_DIR, else .peers/torchtitan under the working directory or under the
    repository root two levels above this file's folder."""
    candidates = (
        [os.environ["TT_PEER_DIR"]]
        if os.environ.get("TT_PEER_DIR")
        else [
            os.path.join(os.getcwd(), ".peers", "torchtitan"),
            os.path.join(HERE, "..", "..", "..", ".peers", "torchtitan"),
        ]
    )
    for folder in candidates:
        if os.path.isfile(os.path.join(folder, "launch.py")) and os.path.isfile(
            os.path.join(folder, "tt_dsv3_small.py")
        ):
            return os.path.abspath(folder)
    raise SystemExit(
        f"the torchtitan peer folder (launch.py, tt_dsv3_small.py, tokenizer/, wheels/) is not at "
        f"{' or '.join(candidates)}: copy it with `cp -r ../shared/peers/torchtitan .peers/` and carry .peers, "
        f"or set TT_PEER_DIR"
    )


def check_torch() -> None:
    """torchtitan 0.3.0 shards routed experts with expert parallelism through FSDP2's per-parameter meshes
    (`ShardPlacementResult`), which torch 2.11 (the GPU machine's) does not have: say so before torchtitan fails at an
    import deep in its parallelize step. EP 1 (FSDP2 over every rank, experts sharded with the rest) runs there."""
    args = sys.argv[1:]
    ep = 1
    for i, a in enumerate(args):
        if a.startswith("--parallelism.expert_parallel_degree"):
            ep = int(a.split("=", 1)[1] if "=" in a else args[i + 1])
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    if ep > 1 and not hasattr(_fsdp_common, "ShardPlacementResult"):
        import torch

        raise SystemExit(f"torchtitan 0.3.0's expert parallelism needs FSDP2 per-parameter meshes "
                         f"(ShardPlacementResult), which torch {torch.__version__} lacks; run EP 1 (FSDP2 over all "
                         f"ranks) on this torch")


def main() -> None:
    check_torch()
    peer = peer_dir()
    for folder in (HERE, peer):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    import launch  # the shared peer's launcher: shims, then torchtitan.train.main()

    launch.main()


if __name__ == "__main__":
    main()
