"""Tests of ``lazarus.moe``."""
