"""What a server process tells about its start: a port it cannot have, and the ready file
for whoever started it. Shared by a server of one process and the supervisor of a group,
neither of which imports the other."""

import json
import os
from pathlib import Path


class PortInUse(OSError):
    """A port another process holds: a server never shares its ports by accident."""

    def __init__(self, flag: str, address: str):
        super().__init__(f"{flag}: {address}: address already in use (by another attnserve "
                         "server, or another program); stop it or choose another port")


def write_ready_file(path: Path, ports: dict[str, int]) -> None:
    """Tell whoever started the server that it serves, on which ports, as which pid:
    written beside `path` and renamed onto it, so a reader never sees half a file."""
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    partial.write_text(json.dumps({**ports, "pid": os.getpid()}))
    os.replace(partial, path)
