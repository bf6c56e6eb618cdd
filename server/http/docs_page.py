"""GET /docs: Swagger UI on this port's /openapi.json, so a person can read every route and
call it from a browser ("Try it out"). Its files come from the swagger-ui-bundle package
and are served from here, never from a CDN: the page's Content-Security-Policy lets it
load and call nothing but this server."""

from aiohttp import web
from swagger_ui_bundle import swagger_ui_path

# The bundle's files the page loads, and their types.
FILES = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript",
         "favicon-32x32.png": "image/png", "favicon-16x16.png": "image/png"}
PAGE = b"""<!DOCTYPE html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>attnserve HTTP API</title>
  <link rel="stylesheet" href="/docs/swagger-ui.css">
  <link rel="icon" type="image/png" href="/docs/favicon-32x32.png" sizes="32x32">
  <link rel="icon" type="image/png" href="/docs/favicon-16x16.png" sizes="16x16">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="/docs/swagger-ui-bundle.js"></script>
  <script src="/docs/start.js"></script>
</body>
</html>
"""
# No validator badge: Swagger UI would fetch it from swagger.io.
START = b"""window.onload = function () {
  window.ui = SwaggerUIBundle({
    url: "/openapi.json",
    dom_id: "#swagger-ui",
    deepLinking: true,
    validatorUrl: null,
    presets: [SwaggerUIBundle.presets.apis],
    layout: "BaseLayout",
  });
};
"""
# Swagger UI sets inline styles and shows images as data: URIs.
POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
          "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'")
# The bundle changes only with the installed package.
CACHE = "public, max-age=3600"


class DocsPage:
    def routes(self) -> list[web.RouteDef]:
        return [web.get("/docs", self.page), web.get("/docs/start.js", self.start),
                web.get("/docs/{file}", self.file)]

    async def page(self, request: web.Request) -> web.Response:
        return web.Response(body=PAGE, content_type="text/html", charset="utf-8",
                            headers={"Content-Security-Policy": POLICY})

    async def start(self, request: web.Request) -> web.Response:
        return web.Response(body=START, content_type="text/javascript", charset="utf-8")

    async def file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["file"]
        if name not in FILES:
            raise web.HTTPNotFound()
        return web.FileResponse(swagger_ui_path / name, headers={
            "Content-Type": FILES[name], "Cache-Control": CACHE})
