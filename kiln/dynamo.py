"""torch.compile(model, backend="kiln"): kiln as a TorchDynamo backend.

Registered through the `torch_dynamo_backends` entry point. Each graph Dynamo captures is
exported and compiled by kiln for its example inputs' shapes; a graph kiln cannot lower
raises (Dynamo reports it as a backend failure), it never falls back to other numbers.
"""

from __future__ import annotations

import torch

from kiln.core.errors import FailedPrecondition


def kiln_backend(gm: torch.fx.GraphModule, example_inputs):
    import kiln

    if not all(isinstance(x, torch.Tensor) for x in example_inputs):
        kinds = sorted({type(x).__name__ for x in example_inputs if not isinstance(x, torch.Tensor)})
        raise FailedPrecondition(f"kiln's torch.compile backend takes tensor inputs only, got {kinds} "
                                 "(dynamic shapes: compile with dynamic=False)")
    compiled = kiln.compile(gm, tuple(example_inputs))

    def run(*args):
        out = compiled(*args)
        return out if isinstance(out, (tuple, list)) else (out,)

    return run
