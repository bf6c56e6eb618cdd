"""--workers N: front-end processes around one engine process. The supervisor starts them
(supervisor.py); they share a page of state (shared.py) and talk over one socket each
(channel.py): the engine process runs the model (engine_process.py), each front end
serves the ports (front_end.py)."""
