"""Corpus documents that ground the designer: the JSONL loader and the default offline corpus."""
