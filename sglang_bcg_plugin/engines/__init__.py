"""Capture engines: how a forward becomes a replayable graph (CUDA graphs or eager)."""
