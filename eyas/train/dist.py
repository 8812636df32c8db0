"""Distributed setup from torchrun's environment (one init/cleanup pair), DDP or FSDP2 wrapping.

The same code runs on one device: without RANK in the environment nothing is initialised and the
module is used as is. FSDP2 (`fully_shard`) shards the whole TTT module as one unit (the draft has a
single decoder layer, so per-layer sharding would buy nothing); full state dicts are gathered for
checkpoints so that they load anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist

from eyas.common import choose_device


@dataclass
class DistInfo:
    enabled: bool
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def init_distributed(device: str = "auto") -> DistInfo:
    if int(os.environ.get("RANK", -1)) == -1:
        return DistInfo(False, 0, 0, 1, choose_device(device))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = choose_device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(True, rank, local_rank, world, dev)


def cleanup(info: DistInfo) -> None:
    if info.enabled and torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def wrap(module: torch.nn.Module, info: DistInfo, fsdp: bool) -> torch.nn.Module:
    if not info.enabled:
        return module
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        return fully_shard(module)
    from torch.nn.parallel import DistributedDataParallel

    ids = [info.device.index] if info.device.type == "cuda" else None
    return DistributedDataParallel(module, device_ids=ids, broadcast_buffers=False)


def all_reduce_sum(values: list[float], info: DistInfo) -> list[float]:
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    torch_dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float], info: DistInfo) -> list[float]:
    """The largest of each value over the ranks: flags every rank must act on together (skip a step, save, stop)."""
    if not info.enabled:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=info.device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return t.tolist()


def model_state(module: torch.nn.Module, fsdp: bool) -> dict:
    """The full (unsharded) state dict of `module` on every rank."""
    if not fsdp:
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(module, optimizer, fsdp: bool) -> dict:
    if not fsdp:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(module, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(module, optimizer, state: dict, fsdp: bool) -> None:
    if not fsdp:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
