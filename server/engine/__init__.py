"""The engine: the protocol-neutral entry point behind every door (plane.py: the models by name; model.py:
what every call to one shares), a module a job (embed.py, chunked.py, pairs.py, sparse.py, multi_vector.py,
classify.py, tensors.py), and the path a request takes: tokenize -> queue -> batch loop."""
