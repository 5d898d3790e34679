"""Tests of ``moc.integrations``: ``test_transformers.py`` tests ``moc/integrations/transformers.py``, and so on."""
