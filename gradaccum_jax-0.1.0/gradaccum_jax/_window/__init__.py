"""The window engine and the transformations built on it.

`accumulate`, conditional, split, fused, loss scaling, the noise-scale probe, the state specs.
"""
