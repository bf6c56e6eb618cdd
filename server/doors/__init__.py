"""The doors: each protocol's adapter onto the data plane (attnserve.v1 and KServe over gRPC;
OpenAI and KServe over HTTP), and what every door shares (front.py). No door imports
another door."""
