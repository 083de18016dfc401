"""The live block-level dashboard (issue 23): `GET /dashboard`, its SSE feed, and
`POST /v1/cache/explain`. `routes.make_dashboard_router` is the one entry point the app uses."""
