"""Typed, frozen, strict inputs: cluster profiles and recipes."""
