"""Sampling text from a model: decoding with a KV cache, and the text a run's tokenizer makes.

generate.py (`fnmoe generate`: greedy, temperature and top-p with a KV cache), text.py (the
tokenizer a run's data was made with, and the short sample a training run logs every
--train.sample-every steps).
"""
