"""Counts in a saved model config, checked before anything is built from it.

Building a model on the meta device costs no memory, but it costs time per module: a saved
``num_layers=1000000`` (ampctl's config, or Hugging Face's ``n_layer`` / ``num_hidden_layers`` in
``config.json``) would take minutes to build before the shapes can be compared with the
checkpoint. Every layer holds at least one tensor, so a config asking for more layers than the
checkpoint holds tensors cannot be the checkpoint's own: it is refused (:class:`ResourceRefused`)
before the build. Standard library only (the error comes from :mod:`ampctl.trust`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["LAYER_KEYS", "check_counts"]

#: Config keys that say how many layers (blocks) a model builds.
LAYER_KEYS = (
    "num_layers",
    "n_layer",
    "n_layers",
    "num_hidden_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "encoder_layers",
    "decoder_layers",
)


def _counts(tree: Any, prefix: str = "", depth: int = 0) -> Iterator[tuple[str, Any]]:
    if depth > 8 or not isinstance(tree, dict):
        return
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if k in LAYER_KEYS:
            yield key, v
        elif isinstance(v, dict):
            yield from _counts(v, key + ".", depth + 1)


def check_counts(config: Any, tensors: int, *, source: str) -> None:
    """Refuse ``config`` (a mapping, or an object with ``to_dict()`` such as a transformers
    config) when a layer count in it is larger than ``tensors``, the number of tensors the
    checkpoint holds, or is not a whole number >= 0. Nothing is built. Raises
    :class:`ampctl.trust.ResourceRefused`."""
    from ampctl.trust import ResourceRefused

    tree = config.to_dict() if callable(getattr(config, "to_dict", None)) else config
    for key, value in _counts(tree):
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue  # not a number: the model's own validation says so
        if value != value or value < 0 or value != int(value):
            raise ResourceRefused(
                f"{source}: the config's {key}={value!r} is not a whole number of layers: "
                "the model is not built"
            )
        if value > tensors:
            raise ResourceRefused(
                f"{source}: the config asks for {key}={int(value)} layers but the checkpoint "
                f"holds {tensors} tensors (each layer has at least one): the model is not built"
            )
