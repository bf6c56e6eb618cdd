"""The engine: the protocol-neutral entry point behind every door (engine.py), and the
path a request takes through it: tokenize -> queue -> batch loop."""
