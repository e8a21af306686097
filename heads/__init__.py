"""Drafter heads (Medusa, EAGLE, DFlash, layer-skip exits), their losses, save/load and export formats.

``heads.load(path, target=None)`` loads a heads folder written by a training run (see ``selfspec.heads.io``);
``heads.save(...)`` writes one. Both import lazily so ``import heads`` stays cheap.
"""

from __future__ import annotations

from typing import Any


def load(path: Any, target: Any = None, **kwargs: Any):
    """Load heads from a folder; with ``target``, check it is theirs (and apply a Medusa-2 adapter). See selfspec.heads.io."""
    # deferred: importing selfspec.heads stays cheap (heads/io.py loads torch and the target)
    from selfspec.heads.io import load_heads

    return load_heads(path, target, **kwargs)


def save(path: Any, module: Any, head_type: str, config: dict, target_model: Any, extra_meta: dict | None = None,
         **kwargs: Any):
    """Write a heads folder atomically. See selfspec.heads.io.save_heads."""
    # deferred: importing selfspec.heads stays cheap (heads/io.py loads torch and the target)
    from selfspec.heads.io import save_heads

    return save_heads(path, module, head_type, config, target_model, extra_meta, **kwargs)


__all__ = ["load", "save"]
