"""Data: corpora in, batches out.

sources.py (reading documents from files and the bundled corpus), prepare.py (`fnmoe prepare`:
tokenizing a corpus into token shards), loader.py (tokenizers, token streams, prepared
directories, the deterministic global-order loader), mixture.py (weighted mixtures of corpora).
"""
