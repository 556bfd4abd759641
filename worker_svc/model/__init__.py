"""The model side of the worker: the decoder families over shared layer ops, their weights' loaders and forms.

layers/ holds one op per file (linear, norms, rotary, attention, activations, MoE), each with its per-mode
implementations; decoder.py the Llama-shaped decoder the families share; families/ one file per family.
"""
