"""The import that model cards exported before version 0.2's reshaping print (``from hpctrain.train.entry import
resolve``): a card lives on in a model-hub folder after the upgrade, so its snippet keeps working. New code and new
cards: ``from hpctrain import resolve_config``. A compatibility shim, the one import of train/ that runs up a layer
(tests/unit/test_layering.py names it)."""

from __future__ import annotations

from typing import Sequence


def resolve(experiment: str, config_file: str | None = None, overrides: Sequence[str] = ()):
    """``hpctrain.resolve_config``, under the name old model cards call."""
    from hpctrain.resolution import resolve_config

    return resolve_config(experiment, config_file, tuple(overrides))
