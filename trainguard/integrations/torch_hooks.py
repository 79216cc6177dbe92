"""PyTorch's own global hooks, feeding a :class:`~.watcher.StepWatcher`: :class:`TorchHooks`.

What is hooked, and what each tells:

============================================  ================================================
``torch.optim`` global step pre/post hooks     phase ``optimizer``; the end of a step (the
                                               first optimizer that steps), its learning rate,
                                               the step number (Adam's restored ``step``)
module forward hooks (global while the first   phase ``forward`` (``eval`` without grad), the
step discovers the top-level modules, then     start of a step, tokens (``input_ids`` or a 2-D
only on those)                                 integer batch)
``torch.autograd.backward``                    phase ``backward``; the loss is the tensor
                                               backward is called on
``register_post_accumulate_grad_hook`` on the  the moment this rank has all its gradients: from
parameter whose gradient comes last            there to ``backward()``'s return it waits for
                                               its peers (DDP's all-reduce, no comm hook)
``torch.distributed.Work.wait``                phase ``collective``, time waiting for peers
                                               (also between steps: it is no step's work)
functional collectives' ``wait_tensor(s)``     the same for DTensor / tensor parallel (patched
                                               from the first optimizer step on)
``torch.nn.utils.clip_grad_norm_``,           the grad norm (its return value, or the norm
``clip_grads_with_norm_``                      clipped with)
``torch.amp.GradScaler.scale``                 the loss before scaling and the loss scale
                                               (mixed precision: backward gets their product,
                                               and an overflow's non-finite grad norm is the
                                               scaler's skip, not a loss gone bad)
``DataLoader`` iterators' ``__next__``         phase ``data``, the start of a step
``torch.save``; DCP's ``save``,                phase ``checkpoint``
``async_save``; ``safetensors.torch``'s        (:mod:`.checkpoint_writers`)
``save_file``, ``save_model``
============================================  ================================================

Every hook is wrapped so that nothing it does can raise into the training script; the wrapped
function's own result and exceptions pass through unchanged. The hooks run inside every step,
so each is one call into the watcher with the common case inline (see the "Overhead" section
of docs/INTEGRATIONS.md for what a step costs). One :class:`TorchHooks` is
installed per process (:func:`installed`); ``uninstall`` puts everything back.
"""
from __future__ import annotations

import logging
import sys
import threading
import weakref
from threading import get_ident

from .checkpoint_writers import WriterPatches
from .watcher import StepWatcher, count_tokens

__all__ = ["TorchHooks", "installed"]

log = logging.getLogger(__name__)

_INSTALLED: "TorchHooks | None" = None
_Tensor = None  # torch.Tensor, set by install
_FUNCOL = "torch.distributed._functional_collectives"
#: the loss scalers whose ``scale`` is hooked, where their module is imported
_SCALERS = (("torch.amp.grad_scaler", "GradScaler"),
            ("torch.distributed.fsdp.sharded_grad_scaler", "ShardedGradScaler"))


def installed() -> "TorchHooks | None":
    return _INSTALLED


def _quiet(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:  # a hook must never break the training loop
        log.debug("trainguard hook %s failed: %s", getattr(fn, "__name__", fn), exc)
        return None


class TorchHooks:
    """Global hooks for one watcher. ``end_steps_on_optimizer``: a step ends when the first
    optimizer that ever stepped steps again (``--instrument``); the framework callbacks end
    steps themselves and set it False."""

    def __init__(self, watcher: StepWatcher, *, end_steps_on_optimizer: bool = True):
        self.watcher = watcher
        self.end_steps_on_optimizer = end_steps_on_optimizer
        self._patched: list[tuple[object, str, object]] = []
        self._handles: list = []
        self._discovery: list = []
        self._roots: "weakref.WeakSet" = weakref.WeakSet()
        self._depth = 0
        self._root_handles: list = []
        self._optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self._last_optimizer = _dead  # weakref of the optimizer that stepped last
        self._primary = None
        self._grad_enabled = None  # torch.is_grad_enabled, at install
        self._calibrated = False
        self._grad_params: dict[int, object] = {}
        self._grad_order: list[int] = []
        self._grad_handles: list = []
        self._grad_discovering = False
        self._backward_depth = 0
        self._funcol_patched = False
        self._scalers: set = set()        # loss scaler classes hooked (_patch_scalers)
        self._writers = WriterPatches(self._set, self._checkpoint_phase)

    # ------------------------------------------------------------------ install
    def install(self) -> "TorchHooks":
        global _INSTALLED, _Tensor
        if _INSTALLED is not None:
            raise RuntimeError("trainguard: torch hooks are installed already")
        import torch

        _Tensor = torch.Tensor
        import torch.nn.modules.module as module_mod
        import torch.optim.optimizer as optim_mod
        import torch.utils.data.dataloader as loader_mod

        self._grad_enabled = torch.is_grad_enabled
        self._patch(torch.autograd, "backward", self._wrap_backward)
        import torch.nn.utils as nn_utils
        import torch.nn.utils.clip_grad as clip_mod

        clip = self._wrap_clip(clip_mod.clip_grad_norm_)
        for owner in (nn_utils, clip_mod):
            self._set(owner, "clip_grad_norm_", clip)
        if hasattr(nn_utils, "clip_grads_with_norm_"):  # norm computed apart (accelerate)
            self._patch(nn_utils, "clip_grads_with_norm_", self._wrap_clip_with_norm)
        self._patch(loader_mod._BaseDataLoaderIter, "__next__", self._wrap_next)
        self._patch_scalers()
        self._patch(torch, "save", self._checkpoint_phase)
        self._writers.install()
        try:
            import torch.distributed as dist

            if dist.is_available():
                self._patch(dist.Work, "wait", self._wrap_wait)
        except (ImportError, AttributeError):
            pass
        self._patch_functional_waits()
        self._handles += [optim_mod.register_optimizer_step_pre_hook(self._optimizer_pre),
                          optim_mod.register_optimizer_step_post_hook(self._optimizer_post)]
        self._discovery = [
            module_mod.register_module_forward_pre_hook(self._discover_pre),
            module_mod.register_module_forward_hook(self._discover_post, always_call=True)]
        _INSTALLED = self
        return self

    def uninstall(self) -> None:
        global _INSTALLED
        self._writers.uninstall()
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        self._scalers.clear()
        for handle in (*self._handles, *self._discovery, *self._root_handles,
                       *self._grad_handles):
            _quiet(handle.remove)
        self._handles, self._discovery, self._root_handles, self._grad_handles = [], [], [], []
        if _INSTALLED is self:
            _INSTALLED = None

    def _set(self, owner, name, value) -> None:
        self._patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def _patch(self, owner, name, wrap) -> None:
        self._set(owner, name, wrap(getattr(owner, name)))

    def _on_training_thread(self) -> bool:
        w = self.watcher
        return w.active and get_ident() == w.thread_id

    # ------------------------------------------------------------------ steps
    def end_step(self, **values) -> None:
        """End the current step (optimizer hook or a framework callback)."""
        self.watcher.end(**values)
        if self._discovery:
            self._finish_discovery()

    def _optimizer_pre(self, optimizer, args, kwargs) -> None:
        w = self.watcher
        if get_ident() != w.thread_id or not w.active:
            return
        if self._last_optimizer() is not optimizer:
            self._last_optimizer = weakref.ref(optimizer)
            if optimizer not in self._optimizers:
                self._optimizers.add(optimizer)
                _quiet(self._watch_gradients, optimizer)
                _quiet(self._patch_functional_waits)
                _quiet(self._patch_scalers)
                _quiet(self._writers.patch_imported)  # one that was mid-import at install
        c = w.collector
        if w.in_step and c is not None and not c.explicit:
            c._phase_state = ("optimizer", c.clock())  # StepWatcher.phase, inline

    def _optimizer_post(self, optimizer, args, kwargs) -> None:
        w = self.watcher
        if not self.end_steps_on_optimizer or get_ident() != w.thread_id or not w.active:
            return
        if self._primary is None:
            self._primary = weakref.ref(optimizer)
        elif self._primary() is not optimizer:
            return
        try:
            if not self._calibrated:
                self._calibrated = True
                done = _optimizer_steps(optimizer)
                if done is not None and done >= 1:
                    self.watcher.next_step = done - 1
            groups = optimizer.param_groups
            w.end(lr=groups[0].get("lr") if groups else None)
            if self._discovery:
                self._finish_discovery()
        except Exception as exc:
            log.debug("trainguard: step end failed: %s", exc)

    # ------------------------------------------------------------------ forward
    def _discover_pre(self, module, args) -> None:
        self._depth += 1
        if self._depth == 1 and self._on_training_thread():
            self._roots.add(module)
            _quiet(self._root_forward, module, args, None)

    def _discover_post(self, module, args, output) -> None:
        self._depth = max(0, self._depth - 1)

    def _finish_discovery(self) -> None:
        for handle in self._discovery:
            _quiet(handle.remove)
        self._discovery = []
        for module in list(self._roots):
            self._root_handles.append(module.register_forward_pre_hook(
                self._root_pre, with_kwargs=True))

    def _root_pre(self, module, args, kwargs):
        w = self.watcher
        if get_ident() == w.thread_id and w.active:
            try:
                w.forward(args, kwargs, module.training and self._grad_enabled())
            except Exception as exc:
                log.debug("trainguard hook forward failed: %s", exc)
        return None

    def _root_forward(self, module, args, kwargs) -> None:
        self.watcher.forward(args, kwargs, module.training and self._grad_enabled())

    # ------------------------------------------------------------------ backward
    def _watch_gradients(self, optimizer) -> None:
        """Discover which parameter gets its gradient last: hook every parameter for the next
        backward, then keep only that one's hook."""
        fresh = [p for group in optimizer.param_groups for p in group["params"]
                 if getattr(p, "requires_grad", False) and id(p) not in self._grad_params]
        if not fresh:
            return
        for handle in self._grad_handles:
            _quiet(handle.remove)
        self._grad_handles = []
        for p in fresh:
            self._grad_params[id(p)] = weakref.ref(p)
        self._grad_order = []
        for key, ref in self._grad_params.items():
            p = ref()
            if p is not None:
                self._grad_handles.append(p.register_post_accumulate_grad_hook(
                    self._make_discovery_hook(key)))
        self._grad_discovering = True

    def _make_discovery_hook(self, key: int):
        order = self._grad_order

        def hook(param):
            order.append(key)
        return hook

    def _settle_gradients(self) -> None:
        if not self._grad_order:
            return
        last = self._grad_params.get(self._grad_order[-1])
        for handle in self._grad_handles:
            _quiet(handle.remove)
        self._grad_handles = []
        self._grad_discovering = False
        param = last() if last is not None else None
        if param is not None:
            self._grad_handles.append(param.register_post_accumulate_grad_hook(self._grad_ready))

    def _grad_ready(self, param) -> None:
        try:
            self.watcher.grad_ready()
        except Exception as exc:
            log.debug("trainguard hook grad_ready failed: %s", exc)

    def _wrap_backward(self, original):
        hooks = self
        w = self.watcher

        def backward(tensors, *args, **kwargs):
            if hooks._backward_depth or get_ident() != w.thread_id or not w.active:
                outer = False
            else:
                outer = True
                try:
                    w.backward_begin(tensors if type(tensors) is _Tensor and tensors.ndim == 0
                                     else _loss_of(tensors))
                except Exception as exc:
                    log.debug("trainguard hook backward failed: %s", exc)
            hooks._backward_depth += 1
            try:
                return original(tensors, *args, **kwargs)
            finally:
                hooks._backward_depth -= 1
                if outer:
                    try:
                        w.backward_done()
                        if hooks._grad_discovering:
                            hooks._settle_gradients()
                    except Exception as exc:
                        log.debug("trainguard hook backward failed: %s", exc)
        backward.__wrapped__ = original
        return backward

    # ------------------------------------------------------------------ the rest
    def _wrap_clip(self, original):
        hooks = self

        w = self.watcher

        def clip_grad_norm_(*args, **kwargs):
            norm = original(*args, **kwargs)
            if w.in_step and get_ident() == w.thread_id:
                w._grad_norm = norm  # note_grad_norm, inline
            return norm
        clip_grad_norm_.__wrapped__ = original
        return clip_grad_norm_

    def _wrap_scale(self, original):
        hooks = self

        def scale(scaler, outputs):
            result = original(scaler, outputs)
            if result is not outputs and type(outputs) is _Tensor and outputs.ndim == 0 \
                    and hooks._on_training_thread():
                _quiet(hooks.watcher.note_scaled, result, outputs,
                       getattr(scaler, "_scale", None))
            return result
        scale.__wrapped__ = original
        return scale

    def _wrap_clip_with_norm(self, original):
        hooks = self

        def clip_grads_with_norm_(parameters, max_norm, total_norm, *args, **kwargs):
            if hooks._on_training_thread():
                _quiet(hooks.watcher.note_grad_norm, total_norm)
            return original(parameters, max_norm, total_norm, *args, **kwargs)
        clip_grads_with_norm_.__wrapped__ = original
        return clip_grads_with_norm_

    def _wrap_wait(self, original):
        hooks = self

        def wait(work, *args, **kwargs):
            if not (hooks.watcher.clocked and hooks._on_training_thread()):
                return original(work, *args, **kwargs)
            w = hooks.watcher
            previous = _quiet(w.phase, "collective")
            _quiet(w.wait_begin)
            try:
                return original(work, *args, **kwargs)
            finally:
                _quiet(w.wait_end)
                _quiet(w.restore, previous)
        wait.__wrapped__ = original
        return wait

    def _patch_scalers(self) -> None:
        """``scale`` of ``torch.amp.GradScaler`` and of the subclasses that replace it
        (FSDP's ``ShardedGradScaler``), once their module is imported (at install, else at
        the first step of each new optimizer: the first step's loss is then the scaled one)."""
        for module, name in _SCALERS:
            cls = getattr(sys.modules.get(module), name, None)
            if cls is not None and "scale" in vars(cls) and cls not in self._scalers:
                self._scalers.add(cls)
                self._patch(cls, "scale", self._wrap_scale)

    def _patch_functional_waits(self) -> None:
        """DTensor (tensor parallel, FSDP2's DTensor ops) waits for its collectives in
        ``wait_tensor``/``wait_tensors`` of the functional collectives module, looked up by
        name when called. Scripts import that module after ``torch``: patched once it is seen
        (at install, else at the first step of each new optimizer; the first step's waits
        are then compute)."""
        funcol = sys.modules.get(_FUNCOL)
        if funcol is None or self._funcol_patched:
            return
        self._funcol_patched = True
        for name in ("wait_tensor", "wait_tensors"):
            if callable(getattr(funcol, name, None)):
                self._patch(funcol, name, self._wrap_functional_wait)

    def _wrap_functional_wait(self, original):
        timed = self._wrap_wait(original)
        import torch

        compiling = torch.compiler.is_compiling

        def wait_tensor(*args, **kwargs):
            if compiling():  # traced by torch.compile: leave the graph as it was
                return original(*args, **kwargs)
            return timed(*args, **kwargs)
        wait_tensor.__wrapped__ = original
        wait_tensor.__name__ = getattr(original, "__name__", "wait_tensor")
        return wait_tensor

    def _wrap_next(self, original):
        hooks = self

        w = self.watcher

        def __next__(iterator):
            if get_ident() != w.thread_id or not w.active:
                return original(iterator)
            try:
                previous = w.fetch()
            except Exception as exc:
                log.debug("trainguard hook fetch failed: %s", exc)
                previous = None
            try:
                batch = original(iterator)
            except StopIteration:
                _quiet(w.abandon)
                _quiet(w.restore, previous)
                raise
            try:
                w.fetched(previous)
            except Exception as exc:
                log.debug("trainguard hook fetch failed: %s", exc)
            return batch
        __next__.__wrapped__ = original
        return __next__

    def _checkpoint_phase(self, original):
        """``original`` run in phase ``checkpoint`` (on the training thread)."""
        hooks = self

        def save(*args, **kwargs):
            if not hooks._on_training_thread():
                return original(*args, **kwargs)
            previous = _quiet(hooks.watcher.phase, "checkpoint")
            try:
                return original(*args, **kwargs)
            finally:
                _quiet(hooks.watcher.restore, previous)
        save.__wrapped__ = original
        return save


def _loss_of(tensors):
    if type(tensors) is _Tensor:  # loss.backward(): the common case
        return tensors if tensors.ndim == 0 or tensors.numel() == 1 else None
    if isinstance(tensors, (list, tuple)):
        tensors = tensors[0] if len(tensors) == 1 else None
    if tensors is not None and hasattr(tensors, "numel") and tensors.numel() == 1:
        return tensors
    return None


def _dead():
    return None


def _optimizer_steps(optimizer) -> int | None:
    """Updates an optimizer has made, from its (checkpoint-restored) state: Adam's ``step``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            value = optimizer.state.get(p, {}).get("step")
            if value is None:
                continue
            if getattr(value, "is_cuda", False):
                return None  # reading it would synchronize
            return int(value.item() if hasattr(value, "item") else value)
    return None
