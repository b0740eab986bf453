"""A minimal third-party backend used to test the registry."""

import numpy as np

import normflat


def layer_problems(model, data, options, **backend_options):
    n = sum(len(y) for _, y in data)
    return [normflat.LayerProblem("fake", np.ones((2, 2)), np.full((2, 2), 0.5))], {"examples": n}


def hessian_diagonal(model, data, options, **backend_options):
    return {"fake": np.full((2, 2), 0.5)}
