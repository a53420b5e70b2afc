"""Shared helpers of the mhsa experiments."""

PAPER = "mhsa"
