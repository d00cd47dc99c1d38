"""Clipping by family: overflow-free measures, norm/value clipping, EMA and growth clippers, AGC."""
