"""The HTTP doors: OpenAI's and Infinity's embeddings (openai.py), text-embeddings-inference's
routes (tei.py), Cohere's and Jina's rerank (cohere.py) and KServe v2 REST (kserve.py), each
a `Door` (door.py) on one port (server.py, listener.py); every JSON body declared once
(schemas.py), the API's description built from them (openapi.py). No door imports another,
and none goes through protobuf."""
