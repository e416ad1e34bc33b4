"""Where the outputs hook's type lived before version 0.2's reshaping (experiments copied from ddpm/ and faceseg/
imported ``from hpctrain.train.outputs import Outputs``): kept so that they still import after an upgrade. New
code: ``from hpctrain import Outputs``."""

from hpctrain.experiments.outputs import Outputs, run_outputs

__all__ = ["Outputs", "run_outputs"]
