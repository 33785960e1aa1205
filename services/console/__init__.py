"""The web console (`squall console`, or a gateway's `[console]` section): a page that shows
the cluster, its topics and its consumers live, built only on the gateway's public API and
the CLI's operator code paths (docs/console.md).

`history` keeps what the console has seen (the failover timeline, topic rates), `backend`
turns gateway answers into the page's JSON, `server` serves the page, its JSON API and
the server-sent event stream; the page itself is in `static/`.
"""
