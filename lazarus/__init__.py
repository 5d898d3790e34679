"""Lazarus: elastic expert-parallel training for Mixture-of-Experts models.

Popular experts get more replicas, replicas are placed so that node failures are
survivable with the highest probability, and after a failure the surviving nodes rebuild
the job and fetch lost expert states from their peers. ``lazarus.planning`` holds the
pure planning functions (no torch); the runtime pieces live in sibling modules.
"""
