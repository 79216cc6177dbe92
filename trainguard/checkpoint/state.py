"""A rank's training state as one tree, and back: model, optimizer, scheduler, RNG, data.

Plain modules give their ``state_dict()``; a model with DTensor parameters (FSDP2, tensor
parallel) goes through ``torch.distributed.checkpoint.state_dict``'s ``get_state_dict`` and
``set_state_dict``, so each rank keeps only its own shards. The RNG states kept are Python's,
torch's CPU generator, CUDA's (when initialised) and numpy's (when numpy is imported).
"""
from __future__ import annotations

import random
import sys
from typing import Any, Optional

__all__ = ["capture", "apply", "is_sharded", "rebuild"]


def is_sharded(model) -> bool:
    return model is not None and any(type(p).__name__ == "DTensor" for p in model.parameters())


def _rng() -> dict:
    import torch

    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng(state: dict) -> None:
    import torch

    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].clone())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for t in state["cuda"]])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(tuple(state["numpy"]))


def capture(step: int, *, model=None, optimizer=None, scheduler=None, data=None,
            extra: Optional[dict] = None) -> dict:
    """The tree to snapshot at ``step`` (steps done). Tensors are the live ones, not copies:
    the snapshot copies them before the next optimizer update may change them."""
    tree: dict = {"step": int(step), "rng": _rng()}
    if model is not None and is_sharded(model):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        tree["model"], optim = get_state_dict(model, optimizer if optimizer is not None else [])
        if optimizer is not None:
            tree["optimizer"] = optim
        tree["sharded"] = True
    else:
        if model is not None:
            tree["model"] = model.state_dict()
        if optimizer is not None:
            tree["optimizer"] = optimizer.state_dict()
    if scheduler is not None:
        tree["scheduler"] = scheduler.state_dict()
    if data is not None:
        tree["data"] = data.state_dict() if hasattr(data, "state_dict") else data
    if extra:
        tree["extra"] = extra
    return tree


def rebuild(tree: Any, mesh) -> Any:
    """``tree`` with each stored DTensor shard made a DTensor again on ``mesh``."""
    from .layout import _Stored

    if isinstance(tree, _Stored):
        from torch.distributed.tensor import DTensor, Replicate, Shard
        from torch.distributed.tensor.placement_types import Partial

        kinds = {"S": lambda p: Shard(p[1]), "R": lambda p: Replicate(),
                 "P": lambda p: Partial()}
        placements = [kinds[p[0]](p) for p in tree.info["placements"]]
        return DTensor.from_local(tree.local.clone(), mesh, placements, run_check=False,
                                  shape=tuple(tree.info["shape"]),
                                  stride=tuple(tree.info["stride"]))
    if isinstance(tree, dict):
        return {k: rebuild(v, mesh) for k, v in tree.items()}
    if isinstance(tree, list):
        return [rebuild(v, mesh) for v in tree]
    return tree


def _mesh(model):
    for p in model.parameters():
        if type(p).__name__ == "DTensor":
            return p.device_mesh
    return None


def apply(tree: dict, *, model=None, optimizer=None, scheduler=None, data=None) -> dict:
    """Load ``tree`` (from :func:`capture`, read back) into the objects; returns the tree's
    ``extra`` (or ``{}``). The tensors of ``tree`` must be the caller's own (not a buffer that
    will be reused): optimizers may keep them as they are."""
    if tree.get("sharded"):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        mesh = _mesh(model)
        set_state_dict(model, optimizer if optimizer is not None else [],
                       model_state_dict=rebuild(tree["model"], mesh),
                       optim_state_dict=rebuild(tree.get("optimizer", {}), mesh))
    else:
        if model is not None and "model" in tree:
            model.load_state_dict(tree["model"])
        if optimizer is not None and "optimizer" in tree:
            optimizer.load_state_dict(tree["optimizer"])
    if scheduler is not None and "scheduler" in tree:
        scheduler.load_state_dict(tree["scheduler"])
    if data is not None and "data" in tree and hasattr(data, "load_state_dict"):
        data.load_state_dict(tree["data"])
    _set_rng(tree.get("rng", {}))
    return tree.get("extra") or {}
