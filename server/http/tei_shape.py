"""What both of TEI's doors (its embedding routes, http_tei.py, and its scoring routes,
http_tei_scores.py) answer alike: TEI's error shape {"error", "error_type"} with TEI's own
statuses, so a client written against TEI reads a refusal as it would TEI's."""

from aiohttp import web

from attnserve.server.errors import InvalidArgument, RequestError

# What the data plane reports -> TEI's status and error_type; Empty is TEI's 400.
STATUSES = {400: (422, "Validation"), 429: (429, "Overloaded"), 500: (424, "Backend"),
            503: (503, "Unhealthy"), 504: (429, "Overloaded")}


class Empty(InvalidArgument):
    """TEI's Empty: an empty input, list or text."""


def refusal(err: RequestError, status: int) -> web.Response:
    status, kind = (400, "Empty") if isinstance(err, Empty) else STATUSES.get(
        status, (status, "Validation"))
    return web.json_response({"error": err.message, "error_type": kind}, status=status)
