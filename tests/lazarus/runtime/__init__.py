"""Tests of ``lazarus.runtime``: its parts, and whole jobs (controller, agents, workers) run as processes."""
