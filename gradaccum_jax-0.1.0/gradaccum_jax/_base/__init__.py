"""The ground floor: version shims, argument checks, collectives and tree helpers.

Imports nothing of ours.
"""
