"""The engine: the protocol-neutral entry point behind every door (data_plane.py), and the
path a request takes through it: tokenize -> queue -> batch loop."""
