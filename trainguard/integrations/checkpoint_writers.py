"""Checkpoint writers besides ``torch.save``, run in phase ``checkpoint``: :class:`WriterPatches`.

FSDP2 and torchtitan jobs save with ``torch.distributed.checkpoint`` (DCP); Hugging Face
writes model weights with ``safetensors``. A save of many minutes outside the ``checkpoint``
phase looks to the hang detector like a stall, so under the hooks each writer of
:data:`WRITERS` runs in that phase on the training thread (``async_save``: its synchronous
part, the staging). A module already imported is patched at once; one imported later right
after its import, before a ``from safetensors.torch import save_file`` elsewhere (as
transformers does at import) binds the unpatched function.
"""
from __future__ import annotations

import sys
from typing import Callable

from .import_hooks import AfterImport

__all__ = ["WRITERS", "WriterPatches"]

#: module -> its checkpoint-writing functions (a package's submodules are patched with it)
WRITERS = {
    "torch.distributed.checkpoint": ("save", "async_save", "save_state_dict"),
    "torch.distributed.checkpoint.state_dict_saver": ("save", "async_save", "save_state_dict"),
    "safetensors.torch": ("save_file", "save_model"),
}
#: the modules whose import is watched (importing one imports the rest of its group)
_WATCHED = ("torch.distributed.checkpoint", "safetensors.torch")


class WriterPatches:
    """Patches the :data:`WRITERS` through ``patch(owner, name, new)`` (the hooks' own, which
    remembers the original for ``uninstall``), each function wrapped once by ``wrap``."""

    def __init__(self, patch: Callable, wrap: Callable):
        self._patch = patch
        self._wrap = wrap
        self._wrapped: dict = {}       # original -> wrapper (one function, several names)
        self._finders: list = []

    def install(self) -> None:
        self.patch_imported()
        for name in _WATCHED:
            if name not in sys.modules:
                finder = AfterImport(name, self.patch_imported)
                self._finders.append(finder)
                sys.meta_path.insert(0, finder)

    def uninstall(self) -> None:
        for finder in self._finders:
            if finder in sys.meta_path:
                sys.meta_path.remove(finder)
        self._finders.clear()

    def patch_imported(self) -> None:
        """Patch every writer of a module imported by now (one still being imported, such as
        ``safetensors.torch`` while it imports ``torch``, is done at a later call)."""
        for module_name, names in WRITERS.items():
            module = sys.modules.get(module_name)
            if module is None:
                continue
            for name in names:
                fn = getattr(module, name, None)
                if not callable(fn) or fn in self._wrapped.values():   # patched already
                    continue
                wrapper = self._wrapped.get(fn)
                if wrapper is None:
                    wrapper = self._wrapped[fn] = self._wrap(fn)
                self._patch(module, name, wrapper)
