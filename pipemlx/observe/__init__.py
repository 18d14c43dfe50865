"""Traces and timelines."""
